"""examples/embed: a C++ program that finds the installed package with find_package(diffuserve),
builds against it, loads a checkpoint, runs prefill + one denoise step, and generates."""
import os
import shutil
import subprocess

import diffuserve as ds
from diffuserve.random_checkpoint import write_random_checkpoint

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "embed")


def test_cpp_program_builds_and_runs(tmp_path):
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed to build examples/embed (pip install cmake)"
    ckpt = write_random_checkpoint(tmp_path / "ckpt", canvas_length=16, vocab_size=64, hidden_size=32,
                                   intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8,
                                   num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    build = tmp_path / "build"
    subprocess.run([cmake, "-S", EXAMPLE, "-B", str(build), f"-Ddiffuserve_DIR={ds.cmake_dir()}",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True, text=True)
    subprocess.run([cmake, "--build", str(build)], check=True, capture_output=True, text=True)
    run = subprocess.run([str(build / "embed"), str(ckpt), "2", "5", "7"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "prefilled 3 tokens" in run.stdout
    assert "canvas 16" in run.stdout
    # The C++ generate entry point gives what the Python API gives for the same request.
    expected = ds.LLM(ckpt).generate([[2, 5, 7]], ds.SamplingParams(max_new_tokens=32, seed=42))[0]
    tokens = run.stdout.split("tokens:")[1].split()
    assert [int(t) for t in tokens] == expected.token_ids

    # A bad checkpoint is a clean error from the C++ API, not a crash.
    bad = subprocess.run([str(build / "embed"), str(tmp_path / "missing")], capture_output=True, text=True)
    assert bad.returncode == 1 and "error:" in bad.stderr
    # Its arguments are read strictly: "abc" is no token id (atoi had made it 0).
    bad = subprocess.run([str(build / "embed"), str(ckpt), "2", "abc"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'abc' is not a token id" in bad.stderr

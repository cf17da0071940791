"""The C++ API under bad and edge input, as a native service drives it: tests/cpp_api is a
program built against the installed CMake package (like examples/embed), one case per
argument; each bad input must be a C++ exception naming what is wrong, never a crash or a hang."""
import os
import re
import shutil
import subprocess

import pytest

import diffuserve as ds
from diffuserve.random_checkpoint import write_random_checkpoint

SOURCE = os.path.join(os.path.dirname(__file__), "cpp_api")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("cpp_api") / "ckpt", canvas_length=16, vocab_size=64,
                                   hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8,
                                   num_experts=4, top_k_experts=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed to build tests/cpp_api (pip install cmake)"
    build = tmp_path_factory.mktemp("cpp_api_build")
    # C++17 as the project's own standard (what GCC 12 defaults to): the package's target
    # must raise it to the C++20 its headers use.
    configure = subprocess.run([cmake, "-S", SOURCE, "-B", str(build), f"-Ddiffuserve_DIR={ds.cmake_dir()}",
                                "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_CXX_STANDARD=17"],
                               capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compile_ = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True)
    assert compile_.returncode == 0, compile_.stdout + compile_.stderr
    return str(build / "api_edges")


def run_case(program, ckpt, case, timeout=120):
    try:
        proc = subprocess.run([program, str(ckpt), case], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case} hung")
    assert proc.returncode == 0, f"{case} crashed (rc {proc.returncode}): {proc.stderr}"
    prefix = f"{case}: "
    assert proc.stdout.startswith(prefix), proc.stdout
    return proc.stdout[len(prefix):].strip()


def test_a_project_without_cxx20_of_its_own_builds(program):
    """find_package + target_link_libraries is all a user's CMake project needs: the headers
    use std::span, and the exported target had not asked for C++20 (a project on GCC's
    default C++17 failed to compile diffuserve.h)."""
    assert os.access(program, os.X_OK)


@pytest.mark.parametrize("flag, message", [
    ("-D_GLIBCXX_DEBUG", "cannot be used with _GLIBCXX_DEBUG"),
    ("-D_GLIBCXX_USE_CXX11_ABI=0", "cannot be used with _GLIBCXX_USE_CXX11_ABI=0")])
def test_every_public_header_refuses_a_standard_library_build_unlike_the_librarys(flag, message):
    """A program built with libstdc++'s debug containers or its old strings would read the
    library's values in another layout: each public header refuses to compile in it (dtype.h
    had not, and read_floats' vector came back as garbage, a segfault)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "a C++ compiler is needed (the package is built with one)"
    headers = sorted(os.listdir(os.path.join(ds.include_dir(), "diffuserve")))
    assert {"config.h", "dtype.h", "errors.h", "diffuserve.h", "engine.h", "generate.h"} <= set(headers)
    for header in headers:
        source = f'#include "diffuserve/{header}"\n'
        proc = subprocess.run([compiler, "-std=c++20", flag, "-I", ds.include_dir(), "-fsyntax-only", "-x", "c++", "-"],
                              input=source, capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stderr, (header, proc.stderr)
        plain = subprocess.run([compiler, "-std=c++20", "-I", ds.include_dir(), "-fsyntax-only", "-x", "c++", "-"],
                               input=source, capture_output=True, text=True)
        assert plain.returncode == 0, (header, plain.stderr)


@pytest.mark.parametrize("case, message", [
    # Planned twice, a request's second segment was read after the first had finished it and
    # freed its state: the same output came back twice, from freed memory.
    ("step_plans_a_request_twice", r"step: request 1 is planned twice"),
    # These had been taken silently (a step that could do nothing, or a negative count).
    ("admit_negative_tokens", r"admit: encode_tokens must be >= 0, got -5"),
    ("reserve_negative_tokens", r"reserve: encode_tokens must be >= 0, got -1"),
    ("step_zero_max_steps", r"step: max_steps must be >= 1, got 0"),
    ("step_zero_max_batched_tokens", r"step: max_batched_tokens must be >= 1, got 0"),
    ("step_negative_max_encode_tokens", r"step: request 1: max_encode_tokens must be >= 0, got -1"),
    # A canvas no pass could hold: the step had done nothing, and a loop stepping until done spun.
    ("step_canvas_past_max_batched_tokens", r"step: request 1's canvas is "),
    ("engine_of_no_model", r"Engine: the model is null"),  # (it had crashed)
    ("denoise_with_one_row_of_self_conditioning",
     r"denoise: self_conditioning_logits holds 64 values, not canvas x vocab = 16 x 64"),
    ("read_floats_of_a_negative_count", r"read_floats: n must be >= 0, got -1"),
    # Taken before (Python's SamplingParams refused them): infinite bounds.
    ("infinite_entropy_bound", r"entropy_bound must be a finite number > 0"),
    ("infinite_confidence_threshold", r"confidence_threshold must be a finite number > 0"),
    ("logit_bias_naming_a_token_twice", "SamplingParams.logit_bias names token 5 twice"),
    ("logit_bias_of_nan", "SamplingParams.logit_bias gives token 5 a bias of nan: a bias is a finite number within "
                          "[-1e+06, 1e+06]"),
    ("logit_bias_past_the_vocabulary", "SamplingParams.logit_bias names token -2, outside the vocabulary [0, "),
])
def test_engine_refuses_bad_plans(program, ckpt, case, message):
    result = run_case(program, ckpt, case)
    assert result.startswith("InvalidArgument: ") and message in result, result


def test_a_path_too_long_to_look_up_is_a_format_error(program, ckpt):
    result = run_case(program, ckpt, "load_a_path_too_long")
    assert result.startswith("FormatError: ") and "is not a checkpoint directory: File name too long" in result, result


def test_a_prompt_chunk_planned_past_the_rows_is_cut_to_them(program, ckpt):
    """A step whose planned prompt chunk is more than max_batched_tokens encodes as many as
    fit (it had run no pass at all, every step, and the request never moved)."""
    result = run_case(program, ckpt, "step_cuts_a_prompt_chunk_to_the_rows")
    canvas = int(result.rsplit(" ", 1)[1])
    assert result == f"ok pending {40 - canvas} of canvas {canvas}", result


def test_generate_with_the_cache_held_elsewhere_is_an_error_not_a_hang(program, ckpt):
    """generate() while another sequence of the model holds all of the cache but one block: the
    prompt was admitted, its first block's commit found no room, and generate() stepped the
    engine forever (each step running no pass)."""
    result = run_case(program, ckpt, "generate_with_the_cache_held", timeout=60)
    assert result.startswith("InvalidArgument: generate: prompt 0: the KV cache has no room for its next 16 tokens"), \
        result
    assert "other sequences of this model hold the rest" in result


def test_generate_chunks_a_prompt_longer_than_the_sliding_pool(program, ckpt):
    """C++ generate() takes a prompt longer than the sliding-window layers' pool holds at once,
    in chunks, as LLM.generate does, and gives its tokens (it had refused it: "does not fit in
    the KV cache", with nearly every block free)."""
    import diffuserve as ds
    result = run_case(program, ckpt, "generate_a_prompt_longer_than_the_sliding_pool")
    assert result.startswith("ok "), result
    prompt = [i * 7 % 64 for i in range(300)]
    expected = ds.LLM(str(ckpt), max_num_seqs=1, num_threads=1).generate(
        [prompt], ds.SamplingParams(max_new_tokens=16, seed=1))[0].token_ids
    assert [int(t) for t in result[3:].split(",")] == expected


def test_generate_stops_at_its_stop_token(program, ckpt):
    """generate(..., std::stop_token): a stop requested before the call ends it before any work,
    and one requested from another thread during a 100,000-token generation after the pass in
    progress, both as Cancelled; the model then generates as before (the requests' KV freed)."""
    assert run_case(program, ckpt, "generate_stopped_before") == \
        "Cancelled: generate: stopped by its stop_token, 0 of 1 prompts done"
    result = run_case(program, ckpt, "generate_stopped_during")
    match = re.fullmatch(r"ok generate: stopped by its stop_token, 0 of 2 prompts done; returned (\d+) ms after the "
                         r"stop; then generated 16", result)
    assert match, result  # (had the stop not come through, the generation would run for minutes: a hang)


def test_a_stop_ends_generates_wait_for_the_model(program, ckpt):
    """A generate() queued behind another thread's call, which holds the model for its whole
    request, ends at its stop while that call still runs (it had waited the call out)."""
    assert run_case(program, ckpt, "generate_stopped_while_another_thread_holds_the_model") == \
        "ok generate: stopped by its stop_token, 0 of 1 prompts done, while the other call ran"


def test_a_cache_too_small_for_max_new_tokens_blames_max_new_tokens(program, ckpt):
    """A 2-token prompt with 100,000 new tokens had been refused as the prompt's fault."""
    result = run_case(program, ckpt, "kv_too_small_for_max_new_tokens")
    assert result.startswith("InvalidArgument: generate: prompt 0: max_new_tokens 100000: "), result
    assert re.search(r"more than the whole cache holds, whose longest sequence is \d+ tokens \(raise kv_cache_memory_bytes",
                     result), result


def test_negative_num_threads_is_refused(program, ckpt):
    """LoadOptions::num_threads -1 had loaded silently, as if 0 (Python refuses it by name)."""
    assert run_case(program, ckpt, "negative_num_threads") == \
        "InvalidArgument: num_threads must be >= 0 (0: the default), got -1"


def test_max_length_caps_prompt_and_new_tokens(program, ckpt):
    """SamplingParams::max_length as transformers applies it: with max_new_tokens at 256, the
    prompt (2 tokens) plus the new ones capped at 7; a prompt that fills it refused by name."""
    assert run_case(program, ckpt, "max_length_caps_new_tokens") == "ok 5 tokens, length"
    assert run_case(program, ckpt, "max_length_leaves_no_room").startswith(
        "InvalidArgument: generate: prompt 0: max_length 2: the prompt (2 tokens) leaves no room for new tokens")


def test_a_prefill_the_cache_cannot_take_is_refused_before_any_chunk(program, ckpt):
    """A first prefill that the cache as it is (another sequence holding half of it) cannot take
    is refused whole, naming its tokens, with nothing encoded; it had been refused a chunk's
    way in, naming the chunk's tokens."""
    result = run_case(program, ckpt, "prefill_past_the_room_other_sequences_leave")
    assert result.startswith("ok refused with 0 tokens encoded: prefill: the KV cache has no room for "), result
    tokens = int(result.split("no room for ")[1].split()[0])
    capacity = tokens + 8
    assert capacity > 100 and f"no room for {capacity - 8} more tokens" in result, result


def test_denoise_takes_its_logits_as_a_span_or_a_pointer(program, ckpt):
    """Sequence::denoise's self-conditioning logits as the checked std::span, or as the pointer
    the API first took (a program written against it still builds): the same logits."""
    assert run_case(program, ckpt, "denoise_with_logits_by_pointer") == "ok same"

"""benchmarks/serve.py (the serving benchmark) and step_latency.py's arguments, on the CPU: a
bad value is a usage error before any model loads; serve.py's table comes from whole requests
of a fixed length, and a failed request ends the run with its error and no table."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from diffuserve.safetensors_io import write_safetensors

from chat_checkpoint import write_chat_checkpoint

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


def run(script, *args, timeout=180):
    return subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("script, args, message", [
    ("serve.py", ["--concurrency", "1,,2"], "argument --concurrency: '' is not an integer"),
    ("serve.py", ["--concurrency", "0"], "argument --concurrency: 0 is outside [1, 65536]"),
    ("serve.py", ["--requests-per-client", "0"], "argument --requests-per-client: 0 is outside"),
    ("serve.py", ["--prompt-tokens", "-5"], "argument --prompt-tokens: -5 is outside"),
    ("serve.py", ["--kv-cache-gib", "0"], "argument --kv-cache-gib: 0 is outside"),
    ("step_latency.py", ["--grid", "0x512"], "argument --grid: 0 is outside [1, 4096]"),
    ("step_latency.py", ["--grid", "1x"], "argument --grid: '' is not an integer"),
    ("step_latency.py", ["--kv-gb", "-1"], "argument --kv-gb: -1 is outside")])
def test_bad_arguments_are_usage_errors(script, args, message):
    """(They had been tracebacks, after the server's start or the model's load.)"""
    result = run(script, *args, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("serve_bench") / "m")


def test_a_run_prints_a_row_per_concurrency(checkpoint):
    result = run("serve.py", "--model", str(checkpoint), "--concurrency", "1,2", "--requests-per-client", "1",
                 "--prompt-tokens", "8", "--max-tokens", "32", "--steps", "1")
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("|")][2:]
    assert [(int(row[0]), int(row[1])) for row in rows] == [(1, 1), (2, 2)]  # (concurrency, requests)
    assert all(float(row[2]) > 0 and all(float(seconds) >= 0 for seconds in row[3:]) for row in rows), rows


def test_a_failed_request_ends_the_run_without_a_table(checkpoint, tmp_path):
    """A request the model cannot finish (NaN logits) sends an error event under its 200: the
    run had counted it as a success of no tokens."""
    path = shutil.copytree(checkpoint, tmp_path / "nan")
    tensors = load_file(path / "model.safetensors")
    tensors["model.decoder.norm.weight"][0] = np.nan
    write_safetensors(path / "model.safetensors", tensors)
    result = run("serve.py", "--model", str(path), "--concurrency", "1", "--requests-per-client", "1",
                 "--prompt-tokens", "8", "--max-tokens", "16", "--steps", "1")
    assert result.returncode == 1 and "error: a request failed: the model's logits held NaN" in result.stderr
    assert "| concurrency" not in result.stdout

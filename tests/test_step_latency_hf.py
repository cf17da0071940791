"""benchmarks/step_latency.py's --hf child process (transformers' forward at every row of the grid), on a
tiny configuration on the CPU: each row's time, and what a row that cannot run says."""
import json
import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from hf_reference import F, S, model_config, text  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from step_latency import hf_forward_ms  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model_config(text([S, F, S]), canvas_length=8).save_pretrained(path)
    return str(path)


def test_every_row_of_the_grid_gets_its_own_time(tiny_path):
    grid = [(1, 5), (2, 19), (3, 4100)]  # the last past one chunk of the context cache
    times = hf_forward_ms(tiny_path, grid, timeout_s=300, device="cpu")
    assert list(times) == grid
    assert all(isinstance(ms, float) and ms > 0 for ms in times.values()), times


def test_a_child_that_fails_says_why_on_every_row(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "diffusion_gemma", "text_config": "broken"}))
    times = hf_forward_ms(str(tmp_path), [(1, 5), (2, 5)], timeout_s=300, device="cpu")
    assert list(times) == [(1, 5), (2, 5)]
    assert all(isinstance(v, str) and v.startswith("failed: ") for v in times.values()), times


def test_rows_not_reached_in_time_say_so(tiny_path):
    times = hf_forward_ms(tiny_path, [(1, 5)], timeout_s=0.01, device="cpu")
    assert times == {(1, 5): "not reached in 0 s"}

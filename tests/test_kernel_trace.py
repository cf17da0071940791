"""benchmarks/kernel_trace.py's busy-time shares and timeline periods, on made-up kernel timelines (no GPU)."""
import os
import random
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from kernel_trace import busy_shares, period  # noqa: E402


def test_a_chain_with_early_starts_charges_each_kernel_from_the_end_of_the_one_before():
    # b and c start early (programmatic dependent launch) and wait for the kernel before
    shares = busy_shares([(0, 10, "a"), (4, 25, "b"), (20, 31, "c")])
    assert shares == {"a": 10, "b": 15, "c": 6}


def test_a_branch_beside_a_longer_kernel_is_charged_only_while_it_started_first():
    # "mlp" runs on another stream beside the long "experts" kernel, which started first
    shares = busy_shares([(0, 100, "experts"), (5, 20, "mlp"), (90, 120, "combine")])
    assert shares == {"experts": 100, "mlp": 0, "combine": 20}


def test_idle_time_is_no_kernels_and_launches_of_one_name_add_up():
    shares = busy_shares([(0, 5, "norm"), (30, 40, "gemm"), (40, 47, "norm"), (47, 47, "empty")])
    assert shares == {"norm": 12, "gemm": 10, "empty": 0}
    assert sum(shares.values()) == 5 + 10 + 7  # the busy time: the gap of 25 is nobody's


def test_the_shares_add_up_to_the_busy_time_of_an_arbitrary_timeline():
    rng = random.Random(7)
    kernels = []
    for i in range(300):
        start = rng.uniform(0, 1000)
        kernels.append((start, start + rng.expovariate(1 / 20), f"k{i % 13}"))
    busy, reach = 0.0, float("-inf")
    for start, end, _ in sorted(kernels):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    assert sum(busy_shares(kernels).values()) == pytest.approx(busy)


def test_a_period_runs_from_the_middle_launch_of_the_anchor_to_the_next_with_times_from_its_start():
    # three "layers", each a norm, a plan and an experts kernel, the MLP beside the experts on stream 2
    kernels = []
    for layer in range(3):
        t = 100.0 * layer
        kernels += [(t, t + 10, 1, "norm"), (t + 10, t + 20, 1, "moe_plan_kernel"), (t + 20, t + 90, 1, "experts"),
                    (t + 30, t + 50, 2, "mlp")]
    random.Random(3).shuffle(kernels)
    assert period(kernels, "moe_plan") == [(0, 10, 1, "moe_plan_kernel"), (10, 80, 1, "experts"),
                                           (20, 40, 2, "mlp"), (90, 100, 1, "norm")]


def test_a_shifted_period_starts_that_many_launches_from_the_middle_one():
    kernels = [(100.0 * layer + t, 100.0 * layer + t + 10, 1, name) for layer in range(5)
               for t, name in ((0, f"norm {layer}"), (10, "moe_plan_kernel"))]
    assert period(kernels, "moe_plan", -2) == [(0, 10, 1, "moe_plan_kernel"), (90, 100, 1, "norm 1")]
    assert period(kernels, "moe_plan", 1) == [(0, 10, 1, "moe_plan_kernel"), (90, 100, 1, "norm 4")]


def test_no_period_where_the_anchor_runs_fewer_than_twice():
    assert period([(0, 5, 1, "moe_plan"), (5, 9, 1, "norm")], "moe_plan") == []
    assert period([(0, 5, 1, "norm")], "moe_plan") == []


def test_no_period_shifted_past_the_launches():
    kernels = [(10.0 * i, 10.0 * i + 5, 1, "moe_plan") for i in range(4)]
    assert period(kernels, "moe_plan", 2) == []  # the last launch has none after it
    assert period(kernels, "moe_plan", -2) == []

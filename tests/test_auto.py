"""method="auto": the cost model's choice, cached, and none where decomposing would lose."""

import pytest
import torch

from commfuse.ops import auto
from commfuse.sim import choose
from commfuse.sim import simulate_op
from commfuse.sim.hardware import preset


def _predicted(op, shape, world, hw="cpu-testbed"):
    """Each candidate's time on the model, through the simulator's public entry point (not
    `choose.fastest`): the simulated op plus the per-step host overhead."""
    return {i: simulate_op(op, m, world, shape, 4, hw, timeline=False, **o).total_s
            + choose.STEP_OVERHEAD_S["cpu"] * choose.steps(op, m, world, o)
            for i, (m, o) in enumerate(choose.CANDIDATES)}


def _expected(op, shape, world, hw="cpu-testbed"):
    t = _predicted(op, shape, world, hw)
    best = min(t.values())
    return choose.CANDIDATES[min(i for i, v in t.items() if v == best)]  # ties: earlier


def test_small_gemms_stay_plain_and_large_ones_decompose():
    # a host that pays as much to post a P2P batch as to launch a collective (0.65 ms each):
    # a tiny GEMM cannot pay for the extra steps
    hw = preset("cpu-testbed").with_(host_collective_s=0.65e-3, host_p2p_s=0.65e-3)
    auto.set_hardware(hw)
    tiny = auto.choose("matmul_rs", (16, 8, 8), 2, torch.ones(1))
    assert tiny == ("none", {}) == _expected("matmul_rs", (16, 8, 8), 2, hw)
    t = _predicted("matmul_rs", (16, 8, 8), 2, hw)
    assert t[0] < min(v for i, v in t.items() if i)  # none strictly wins: latency dominates
    auto.set_hardware("cpu-testbed")
    shape = (4096, 2048, 2048)
    big = auto.choose("matmul_rs", shape, 4, torch.ones(1))
    assert big == _expected("matmul_rs", shape, 4)
    t = _predicted("matmul_rs", shape, 4)
    assert big[0] != "none" and min(t.values()) < t[0]  # decomposing is predicted faster


@pytest.mark.parametrize("op,shape", [("ag_matmul", (4096, 1024, 1024)),
                                      ("matmul_a2a", (2048, 1024, 3072))])
def test_choice_is_the_fastest_candidate_on_the_model(op, shape):
    assert auto.choose(op, shape, 2, torch.ones(1)) == _expected(op, shape, 2)


def test_choices_are_cached_and_hardware_can_be_set():
    a = auto.choose("ag_matmul", (1024, 512, 512), 2, torch.ones(1))
    assert auto.choose("ag_matmul", (1024, 512, 512), 2, torch.ones(1)) is a  # cached
    auto.set_hardware("h100-nvlink")  # another model: the cache is dropped, the choice follows
    shape = (4096, 1024, 1024)
    assert auto.choose("ag_matmul", shape, 2, torch.ones(1)) == _expected(
        "ag_matmul", shape, 2, "h100-nvlink")
    with pytest.raises(ValueError, match="unknown hardware preset"):
        auto.set_hardware("no-such-gpu")

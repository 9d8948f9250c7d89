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
    """The fastest candidate (ties: the earlier), unless it is not faster than the default
    (commfuse at best_splits' m) by more than the model's margin."""
    t = _predicted(op, shape, world, hw)
    best = min(t.values())
    pick = choose.CANDIDATES[min(i for i, v in t.items() if v == best)]
    hw = preset(hw) if isinstance(hw, str) else hw
    m = choose.best_splits(op, shape, world, 4, hw)
    default = ("commfuse", {"topology": "ring", "splits": m})
    t_default = simulate_op(op, "commfuse", world, shape, 4, hw, timeline=False, splits=m).total_s \
        + choose.STEP_OVERHEAD_S["cpu"] * choose.steps(op, "commfuse", world, default[1])
    if pick[0] == "commfuse" and {"splits": 1, **pick[1]} == default[1]:
        return pick
    return pick if best <= (1 - hw.choice_margin) * t_default else default


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


def test_auto_keeps_the_default_unless_its_gain_exceeds_the_models_margin():
    # GEMM->RS on 4 ranks: the direct topology is predicted 1.2 % faster than the default
    # (the ring at best_splits' m) at 1024 rows, 7 % at 256: only the second is told apart
    hw = preset("cpu-testbed")
    assert hw.choice_margin > 0
    for shape, departs in (((1024, 512, 512), False), ((256, 256, 256), True)):
        fast = choose.fastest("matmul_rs", shape, 4, 4, hw)
        default = choose.default("matmul_rs", shape, 4, 4, hw)
        t_default = choose.fastest("matmul_rs", shape, 4, 4, hw, candidates=[default])[2]
        assert fast[1] == {"topology": "direct"} and fast[2] < t_default
        assert (fast[2] < (1 - hw.choice_margin) * t_default) == departs
        method, opts, t = choose.choice("matmul_rs", shape, 4, 4, hw)
        assert ((method, opts), t) == ((fast[:2], fast[2]) if departs else (default, t_default))
        assert choose.choice("matmul_rs", shape, 4, 4, hw.with_(choice_margin=0)) == fast
        auto.set_hardware(hw)
        assert auto.choose("matmul_rs", shape, 4, torch.ones(1)) == (method, opts)

"""method="auto": the cost model's choice, cached, and none where decomposing would lose."""

import pytest
import torch

from commfuse.ops import auto
from commfuse.sim import choose
from commfuse.sim import simulate_op


def test_small_gemms_stay_plain_and_large_ones_decompose():
    tiny = auto.choose("matmul_rs", (16, 8, 8), 2, torch.ones(1))
    assert tiny == ("none", {})  # a few microseconds of GEMM: latency would dominate
    big = auto.choose("matmul_rs", (4096, 2048, 2048), 4, torch.ones(1))
    assert big[0] in ("commfuse", "decompose", "sliced")


@pytest.mark.parametrize("op,shape", [("ag_matmul", (4096, 1024, 1024)),
                                      ("matmul_a2a", (2048, 1024, 3072))])
def test_choice_is_the_fastest_candidate_on_the_model(op, shape):
    method, opts = auto.choose(op, shape, 2, torch.ones(1))
    hw = auto._HARDWARE.get("cpu") or "cpu-testbed"
    t = lambda m, o: (simulate_op(op, m, 2, shape, 4, hw, timeline=False, **o).total_s
                      + choose.STEP_OVERHEAD_S["cpu"] * choose.steps(op, m, 2, o))
    assert t(method, opts) == min(t(m, o) for m, o in choose.CANDIDATES)


def test_choices_are_cached_and_hardware_can_be_set():
    auto.set_hardware("cpu-testbed")
    a = auto.choose("ag_matmul", (1024, 512, 512), 2, torch.ones(1))
    assert auto.choose("ag_matmul", (1024, 512, 512), 2, torch.ones(1)) is a
    with pytest.raises(ValueError, match="unknown hardware preset"):
        auto.set_hardware("no-such-gpu")

"""method="auto" on ranks configured with different hardware models (`set_hardware` is per
process): every rank raises instead of running different schedules; ranks that agree pay one
small all-gather per shape and group, then nothing."""

import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse.ops import auto
from commfuse.testbed.spawn import run_local


def _differently_configured(rank, world, method):
    auto.set_hardware("cpu-testbed" if rank == 0 else "h100-nvlink")
    a, b = torch.randn(16 * world, 64), torch.randn(64, 32)
    try:
        commfuse.fused_matmul_reduce_scatter(a, b, "sum", 0, method=method, timeout=20)
    except commfuse.CommFuseError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("method", ("auto",))
def test_ranks_with_different_hardware_models_raise_on_every_rank(method):
    for msg in run_local(_differently_configured, 2, method, timeout=120):
        assert "matmul_rs (" in msg and "chosen by the cost model" in msg, msg
        assert "ranks [0] / [1]" in msg, msg
        assert "set_hardware" in msg, msg


def _agreeing(rank, world):
    auto.set_hardware("cpu-testbed")
    calls, real = [0], dist.all_gather

    def counting(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)

    dist.all_gather = counting
    a, b = torch.randn(16 * world, 64), torch.randn(64, 32)
    first = commfuse.fused_matmul_reduce_scatter(a, b, "sum", 0, method="auto")
    after_first = calls[0]
    again = commfuse.fused_matmul_reduce_scatter(a, b, "sum", 0, method="auto")
    dist.all_gather = real
    return after_first, calls[0], torch.equal(first, again)


def test_agreeing_ranks_exchange_once_per_shape():
    for after_first, total, same in run_local(_agreeing, 3, timeout=120):
        assert (after_first, total, same) == (1, 1, True)


def _moe_differently_configured(rank, world):
    from commfuse.ops.moe import moe_dispatch_matmul
    from commfuse.schedule.moe import ExpertCounts

    auto.set_hardware("cpu-testbed" if rank == 0 else "h100-nvlink")
    counts = ExpertCounts(((3, 1, 2, 2),) * world)
    x, w = torch.randn(8, 16), torch.randn(2, 16, 8)
    try:
        moe_dispatch_matmul(x, w, counts, dist.group.WORLD, method="auto", timeout=20)
    except commfuse.CommFuseError as e:
        return str(e)
    return "no error"


def test_moe_ranks_with_different_hardware_models_raise_on_every_rank():
    for msg in run_local(_moe_differently_configured, 2, timeout=120):
        assert "moe_dispatch (" in msg and "chosen by the cost model" in msg, msg
        assert "ranks [0] / [1]" in msg and "set_hardware" in msg, msg

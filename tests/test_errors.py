"""Bad input raises a clear error naming the argument, before any communication; a dead peer
raises `CommFuseError` within the timeout instead of hanging."""

import time

import pytest
import torch

import commfuse
from commfuse.testbed.spawn import RankFailed, run_local

F = torch.float32


def _bad_calls():
    a2, b = torch.ones(4, 8), torch.ones(8, 6)
    return [
        ("shapes do not multiply", lambda: commfuse.fused_all_gather_matmul(a2, [torch.ones(7, 6)], 0)),
        ("Bs must be", lambda: commfuse.fused_all_gather_matmul(a2, b, 0)),
        ("gather_dim cannot be the last", lambda: commfuse.fused_all_gather_matmul(a2, [b], 1)),
        ("gather_dim=2 is out of range", lambda: commfuse.fused_all_gather_matmul(a2, [b], 2)),
        ("gather_dim must be an int", lambda: commfuse.fused_all_gather_matmul(a2, [b], 0.0)),
        ("Bs\\[0\\] has dtype", lambda: commfuse.fused_all_gather_matmul(a2, [b.double()], 0)),
        ("reduce_op", lambda: commfuse.fused_matmul_reduce_scatter(a2, b, "max", 0)),
        ("one entry per rank", lambda: commfuse.fused_matmul_reduce_scatter(
            torch.ones(3, 8), b, "sum", 0, sizes=[3])),
        ("sum to 2 but the dim has 3", lambda: commfuse.fused_matmul_reduce_scatter(
            torch.ones(3, 8), b, "sum", 0, sizes=[1, 1])),
        ("non-negative", lambda: commfuse.fused_all_to_all_matmul(
            torch.ones(3, 4), torch.ones(8, 5), sizes=[-1, 4])),
        ("this rank's slice has 4 rows", lambda: commfuse.fused_all_gather_matmul(
            a2, [b], 0, sizes=[3, 3])),
        ("sizes must be a list", lambda: commfuse.fused_matmul_all_to_all(
            a2, torch.ones(8, 6), sizes=4)),
        ("scatter_dim cannot be the last", lambda: commfuse.fused_matmul_reduce_scatter(a2, b, "sum", -1)),
        ("columns to scatter", lambda: commfuse.fused_matmul_all_to_all(a2, torch.ones(8, 5))),
        ("B must be \\[group size", lambda: commfuse.fused_all_to_all_matmul(a2, torch.ones(8, 5))),
        ("seq_dim", lambda: commfuse.fused_all_to_all_matmul(torch.ones(3, 4), torch.ones(8, 5), seq_dim=1)),
        ("method must be one of", lambda: commfuse.fused_all_gather_matmul(a2, [b], 0, method="fast")),
        ("unknown option", lambda: commfuse.fused_all_gather_matmul(a2, [b], 0, method="none", chunks=2)),
        ("topology must be", lambda: commfuse.fused_all_gather_matmul(a2, [b], 0, topology="tree")),
        ("chunks must be", lambda: commfuse.fused_all_gather_matmul(a2, [b], 0, method="sliced", chunks=0)),
        ("timeout must be", lambda: commfuse.fused_all_gather_matmul(a2, [b], 0, timeout=-1)),
        ("floating-point", lambda: commfuse.fused_all_gather_matmul(a2.long(), [b.long()], 0)),
        ("must be a torch.Tensor", lambda: commfuse.fused_matmul_reduce_scatter([1], b, "sum", 0)),
        ("save_gathered must be a bool", lambda: commfuse.fused_all_gather_matmul(
            a2, [b], 0, save_gathered="yes")),
    ]


def _raise_each(rank, world):
    """Every bad call raises ValueError/TypeError here, on every rank, and no rank blocks."""
    seen = []
    for match, call in _bad_calls():
        try:
            call()
        except (ValueError, TypeError) as e:
            import re
            seen.append(None if re.search(match, str(e)) else f"{match!r} not in {e}")
        else:
            seen.append(f"{match!r}: no error")
    return seen


def test_bad_input_raises_clear_errors_on_every_rank():
    # two ranks, so the sizes checks are meaningful; if any call communicated
    # before failing, the ranks would desynchronise and the next collective would time out
    out = run_local(_raise_each, 2, timeout=120)
    assert out[0] == out[1] == [None] * len(_bad_calls())


def test_uninitialised_distributed_is_a_clear_error():
    with pytest.raises(RuntimeError, match="init_process_group"):
        commfuse.fused_all_gather_matmul(torch.ones(4, 8), [torch.ones(8, 6)], 0)


def _peer_dies(rank, world, method):
    if rank == 1:
        return "exited"  # never joins the op: the peer is gone
    t0 = time.monotonic()
    try:
        commfuse.fused_matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 6), "sum", 0,
                                             method=method, timeout=3)
    except commfuse.CommFuseError as e:
        return (time.monotonic() - t0, str(e))
    return "no error"


@pytest.mark.parametrize("method", ["commfuse", "decompose", "sliced", "none"])
def test_missing_peer_raises_within_the_timeout(method):
    # the group's own timeout is 300 s: an error well before it is the op's timeout (3 s) at
    # work, however slowly this shared machine runs (no tight wall-clock bound)
    out = run_local(_peer_dies, 2, method, timeout=240, pg_timeout_s=300)
    elapsed, msg = out[0]
    assert elapsed < 120, msg
    assert "matmul_rs" in msg and f"method={method}" in msg and "step" in msg


def _raise_on_rank(rank, world):
    raise KeyError(f"boom on {rank}")


def test_spawn_reports_a_rank_failure():
    with pytest.raises(RankFailed, match="boom"):
        run_local(_raise_on_rank, 2, timeout=60)

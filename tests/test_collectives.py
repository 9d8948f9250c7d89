"""commfuse.runtime.collectives: the point-to-point collectives against torch.distributed's
own, on 2, 3 and 4 ranks (the fused ops' tests cover the other kinds through every method)."""

import pytest
import torch

from commfuse.testbed.spawn import run_local


def _all_reduce_rank(rank, world):
    """The P2P all-reduce, in place and into another tensor, against gloo's own, and the
    reduce-scatter's one-pass sum against gloo's; float64 partials of mixed magnitude so a
    different order of the sum would show."""
    from datetime import timedelta

    import torch.distributed as dist

    from commfuse.runtime import collectives

    g = dist.group.WORLD
    torch.manual_seed(rank)
    part = torch.randn(7, 3, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (7, 3))
    want = part.clone()
    dist.all_reduce(want)
    every = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(every, part)
    in_order = every[0].clone()
    for p in every[1:]:
        in_order += p
    got = {}
    for how in ("in place", "into out"):
        inp = part.clone()
        out = inp if how == "in place" else torch.full_like(part, float("nan"))
        collectives.launch("all_reduce", out, inp, g, 11, "p2p").wait(timedelta(seconds=30))
        got[how] = out
    rs_out = torch.empty(2, 3, dtype=torch.float64)
    rs_in = torch.arange(2 * world * 3, dtype=torch.float64).reshape(2 * world, 3) * (rank + 1)
    collectives.launch("reduce_scatter", rs_out, rs_in, g, 12, "p2p").wait(
        timedelta(seconds=30))
    rs_want = torch.empty_like(rs_out)
    dist.reduce_scatter_tensor(rs_want, rs_in)
    backend = part.clone()
    collectives.launch("all_reduce", backend, backend, g, 13, "backend").wait()
    return ({k: (v - want).abs().max().item() for k, v in got.items()},
            all(torch.equal(v, in_order) for v in got.values()),
            (backend - want).abs().max().item(), torch.equal(rs_out, rs_want), got["in place"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_p2p_all_reduce_matches_torch(world):
    results = run_local(_all_reduce_rank, world, timeout=120)
    for errors, in_order, backend_err, rs_ok, _ in results:
        assert max(errors.values()) < 1e-6, errors  # float64 rounding of sums up to 1e8
        assert in_order  # exactly the rank-order sum
        assert backend_err < 1e-6 and rs_ok
    for r in results[1:]:  # bitwise the same on every rank
        assert torch.equal(r[4], results[0][4])


def test_unknown_kind_is_refused():
    from commfuse.runtime import collectives

    with pytest.raises(ValueError, match="all_reduce"):
        collectives.launch("broadcast", torch.zeros(1), torch.zeros(1), None, 0, "p2p")

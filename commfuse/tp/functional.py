"""The small autograd pieces the TP styles put around commfuse's fused ops.

Each is a Megatron-style conjugate pair (forward / backward) over one ProcessGroup:

    shard_seq     slice this rank's sequence shard     all-gather the shards' gradients
    gather_cols   all-gather the column shards         keep this rank's columns of the gradient
    sum_grad      identity                             all-reduce (sum) the gradient

``sum_grad`` is how a replicated parameter that sees only part of the work on each rank (a
norm on a sequence shard, a bias added to a shard, q_norm/k_norm on a head group) gets the
gradient of the whole: the parameter enters the forward through it. With ``slots`` it sums
only among ranks that hold the same slot (replicated kv heads): each rank adds its gradient
into its slot of a zero buffer, one all-reduce sums every slot, each keeps its own.

Legend: S the whole dim, s this rank's part of it (``sizes[rank]``), N columns.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def chunk_sizes(n: int, world: int) -> tuple[int, ...]:
    """Rows per rank of a DTensor ``Shard`` of ``n`` rows (torch.chunk's split: 10 over 4 is
    3, 3, 3, 1), which is how the styles shard weights."""
    c = -(-n // world)
    return tuple(max(0, min(c, n - i * c)) for i in range(world))


def all_gather_dim(t: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """No autograd: the ranks' parts of ``dim`` (rank p's has ``sizes[p]``), concatenated.
    Parts are padded to the longest for the backend's all-gather."""
    longest = max(sizes)
    pad = t
    if t.shape[dim] < longest:
        shape = list(t.shape)
        shape[dim] = longest - t.shape[dim]
        pad = torch.cat([t, t.new_zeros(shape)], dim)
    parts = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(parts, pad.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)


class _ShardSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_S, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        r = group.rank()
        return x_S.narrow(dim, sum(sizes[:r]), sizes[r]).clone()

    @staticmethod
    def backward(ctx, g_s):
        return all_gather_dim(g_s, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _GatherCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_n, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return all_gather_dim(y_n, y_n.dim() - 1, sizes, group)

    @staticmethod
    def backward(ctx, g_N):
        r = ctx.group.rank()
        return g_N.narrow(-1, sum(ctx.sizes[:r]), ctx.sizes[r]).contiguous(), None, None


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, group, slot, slots):
        ctx.group, ctx.slot, ctx.slots = group, slot, slots
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        buf = g.new_zeros((ctx.slots, *g.shape))
        buf[ctx.slot].copy_(g)
        dist.all_reduce(buf, group=ctx.group)
        return buf[ctx.slot], None, None, None


def shard_seq(x_S: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """This rank's part of ``dim`` (rank p's is ``sizes[p]`` long, in rank order); the
    backward all-gathers the parts' gradients, so what came before sees the whole gradient
    (no further sum over the group: every rank computed the same input)."""
    return _ShardSeq.apply(x_S, dim, tuple(sizes), group)


def gather_cols(y_n: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """The column shards of every rank (rank p's has ``sizes[p]`` columns) side by side; the
    backward keeps this rank's columns (what follows ran the same on every rank)."""
    return _GatherCols.apply(y_n, tuple(sizes), group)


def sum_grad(p: torch.Tensor, group, slot: int = 0, slots: int = 1) -> torch.Tensor:
    """``p`` unchanged; its gradient summed over the ranks of ``group`` that pass the same
    ``slot`` (of ``slots``; default: every rank)."""
    return _SumGrad.apply(p, group, slot, slots)

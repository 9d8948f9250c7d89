"""The small autograd pieces the TP styles put around commfuse's fused ops.

Each is a Megatron-style conjugate pair (forward / backward) over one ProcessGroup:

    shard_seq     slice this rank's sequence shard     all-gather the shards' gradients
    gather_cols   all-gather the column shards         keep this rank's columns of the gradient
    sum_grad      identity                             all-reduce (sum) the gradient
    scatter_sum   reduce-scatter partial sums          all-gather the shards' gradients
    all_sum       all-reduce (sum)                     all-reduce (sum) the gradient
    scale_grad    identity                             scale, then all-reduce (sum)

``sum_grad`` is how a replicated parameter that sees only part of the work on each rank (a
norm on a sequence shard, a bias added to a shard, q_norm/k_norm on a head group) gets the
gradient of the whole: the parameter enters the forward through it. With ``slots`` it sums
only among ranks that hold the same slot (replicated kv heads): each rank adds its gradient
into its slot of a zero buffer, one all-reduce sums every slot, each keeps its own.

In ``compute_only`` measurement mode (`commfuse.runtime.modes`) each piece moves nothing and
keeps its shapes: a gather repeats this rank's part in every rank's place, a reduce-scatter
keeps this rank's part of its own input, a sum is this rank's term.

Legend: S the whole dim, s this rank's part of it (``sizes[rank]``), N columns.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from commfuse.runtime import modes


def _moving() -> bool:
    """Whether the collectives move data (not in ``compute_only`` mode)."""
    return modes.current() != "compute_only"


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
    if _moving():
        parts = [torch.empty_like(pad) for _ in sizes]
        dist.all_gather(parts, pad.contiguous(), group=group)
    else:
        parts = [pad for _ in sizes]
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
        return _slot_sum(g, ctx.group, ctx.slot, ctx.slots), None, None, None


class _MeanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, group, scale):
        ctx.group, ctx.scale = group, scale
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        g = g * ctx.scale
        if ctx.group is not None and _moving():
            dist.all_reduce(g, group=ctx.group)
        return g, None, None


def scale_grad(p: torch.Tensor, scale: float, group=None) -> torch.Tensor:
    """``p`` unchanged; its gradient times ``scale``, then summed over ``group`` (if any)."""
    return _MeanGrad.apply(p, group, scale)


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


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_S, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        longest, parts = max(sizes), []
        for p in x_S.split(list(sizes), dim):
            if p.shape[dim] < longest:
                shape = list(p.shape)
                shape[dim] = longest - p.shape[dim]
                p = torch.cat([p, p.new_zeros(shape)], dim)
            parts.append(p.contiguous())
        out = torch.empty_like(parts[0])
        if _moving():
            dist.reduce_scatter(out, parts, group=group)
        else:
            out.copy_(parts[group.rank()])
        return out.narrow(dim, 0, sizes[group.rank()]).contiguous()

    @staticmethod
    def backward(ctx, g_s):
        return all_gather_dim(g_s, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _AllSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, slot, slots):
        ctx.args = group, slot, slots
        return _slot_sum(x, group, slot, slots)

    @staticmethod
    def backward(ctx, g):
        return _slot_sum(g, *ctx.args), None, None, None


def _slot_sum(x: torch.Tensor, group, slot: int, slots: int) -> torch.Tensor:
    if slots == 1:
        x = x.clone()
        if _moving():
            dist.all_reduce(x, group=group)
        return x
    buf = x.new_zeros((slots, *x.shape))
    buf[slot].copy_(x)
    if _moving():
        dist.all_reduce(buf, group=group)
    return buf[slot]


def scatter_sum(x_S: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """This rank's part of ``dim`` of the sum of every rank's ``x_S`` (a reduce-scatter;
    rank p's part is ``sizes[p]`` long); the backward all-gathers the parts' gradients, so
    each rank's ``x_S`` gets the whole gradient (it entered the sum once)."""
    return _ScatterSum.apply(x_S, dim, tuple(sizes), group)


def all_sum(x: torch.Tensor, group, slot: int = 0, slots: int = 1) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group`` that pass the same ``slot`` (of ``slots``;
    default: every rank), an all-reduce; its gradient is summed the same way (each rank's
    output read every such rank's ``x``)."""
    return _AllSum.apply(x, group, slot, slots)

"""The small autograd pieces the TP styles put around commfuse's fused ops.

Each is a Megatron-style conjugate pair (forward / backward) over one ProcessGroup:

    shard_seq     slice this rank's sequence shard     all-gather the shards' gradients
    gather_cols   all-gather the column shards         keep this rank's columns of the gradient
    sum_grad      identity                             all-reduce (sum) the gradient
    sum_grad_later  identity                           the same all-reduce, posted; added
                                                       into ``.grad`` when the backward ends
    scatter_sum   reduce-scatter partial sums          all-gather the shards' gradients
    all_sum       all-reduce (sum)                     all-reduce (sum) the gradient
    scale_grad    identity                             scale, then all-reduce (sum)
    sum_ranks     all-reduce (sum)                     identity

``sum_grad`` is how a replicated parameter that sees only part of the work on each rank (a
norm on a sequence shard, a bias added to a shard, q_norm/k_norm on a head group) gets the
gradient of the whole: the parameter enters the forward through it. With ``slots`` it sums
only among ranks that hold the same slot (replicated kv heads): each rank adds its gradient
into its slot of a zero buffer, one all-reduce sums every slot, each keeps its own.

``sum_grad_later`` lets the backward go on while the sum travels (DDP's overlap, one
parameter per all-reduce): the graph gives the parameter zeros, and a callback queued on the
autograd engine waits for every posted sum when the backward ends and adds each into its
``.grad``: the same additions as ``sum_grad``'s. Whatever reads ``.grad`` during the backward
(a post-accumulate-grad hook, DDP's reducer, FSDP2's reduce-scatter) would read it unsummed,
and ``torch.autograd.grad`` has no ``.grad`` to add to (an error when the backward ends):
so it is opt-in (`commfuse.tp.parallelize`'s ``defer_grad_sums``), used only for parameters
the style registered itself and still finds on the module, and never under Dynamo.

In ``compute_only`` measurement mode (`commfuse.runtime.modes`) each piece moves nothing and
keeps its shapes: a gather repeats this rank's part in every rank's place, a reduce-scatter
keeps this rank's part of its own input, a sum is this rank's term.

Legend: S the whole dim, s this rank's part of it (``sizes[rank]``), N columns.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from commfuse.runtime import deadlines, modes


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


class _SumRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def sum_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group`` (an all-reduce); the backward passes the
    gradient through unchanged (what follows ran the same on every rank, so each rank's
    gradient of the sum is already the whole one: Megatron's reduce-from-region)."""
    return _SumRanks.apply(x, group)


class _Pending:
    """The sums posted in the current backward: (parameter, work, buffer), and whether the
    engine callback that waits for them is queued."""

    def __init__(self):
        self.sums: list[tuple[torch.nn.Parameter, object, torch.Tensor, object]] = []
        self.queued = False

    def add(self, param, work, buf, group) -> None:
        self.sums.append((param, work, buf, group))
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.queued = True

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every posted sum (in posting order) and add it into its ``.grad``."""
        sums, self.sums, self.queued = self.sums, [], False
        for param, work, buf, group in sums:
            deadlines.wait(work, group, buf.device, None)
            grad = param.grad
            if grad is None:
                raise RuntimeError(
                    "commfuse.tp: a deferred gradient sum found no .grad to add to (the "
                    "backward ran as torch.autograd.grad?); parallelize with "
                    "defer_grad_sums=False for that")
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.add_(buf)


_PENDING = _Pending()


class _SumGradLater(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, param, group):
        ctx.param, ctx.group = param, group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        if not _moving():
            return g, None, None  # moving nothing: this rank's term
        buf = g.clone(memory_format=torch.contiguous_format)  # one copy: the sum is in place
        # posted now: the sum travels while the backward computes the layers before this one
        work = dist.all_reduce(buf, group=ctx.group, async_op=True)
        _PENDING.add(ctx.param, work, buf, ctx.group)
        return torch.zeros_like(g), None, None


def sum_grad_later(t: torch.Tensor, param: torch.nn.Parameter, group) -> torch.Tensor:
    """``t`` (``param``'s local tensor) unchanged; its gradient summed over ``group`` into
    ``param.grad`` when the backward ends (the all-reduce posted where the backward reaches
    ``t``; module docstring)."""
    return _SumGradLater.apply(t, param, group)

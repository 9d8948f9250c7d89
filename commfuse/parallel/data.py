"""Sharded data parallelism (ZeRO-3 style) over the DP group of P ranks.

Every Linear weight W_OI [out, in] is kept as its rows ``[r*o, (r+1)*o)``, o = out / P (out
must be divisible by P). The forward gathers it *fused with the GEMM*:

    Y_ON = fused_all_gather_matmul(W_oI, [X_NI^T], gather_dim=0, group=dp)    (= (X @ W^T)^T)

and the autograd backward of that op is the dual GEMM -> reduce-scatter, which is exactly the
weight-gradient GEMM fused with the gradient reduce-scatter: dW_oI = RS(dY_ON @ X_NI). Each
rank receives its gradient shard directly, with no separate collective. (The op also returns
dX^T = W^T @ dY locally.) Only the shard is saved for backward: the backward gathers W again,
fused as in the forward, its row-slices feeding dX^T = sum_slot W[slot]^T @ dY[slot] as they
arrive, so no layer's full weight outlives its forward or its backward.

Not sharded: norms and the embedding stay replicated; their gradients are summed with a plain
all-reduce (`ParallelLlama.sync_grads`). Under TP x DP / UP x DP the weight that the TP / UP
op needs is first gathered with a plain all-gather whose backward is a reduce-scatter
(`ShardedLinear.gather`): the TP / UP collectives are the fused ones there. Under
`regathered`, a gathered weight that an op saves for backward is saved as the shard and
gathered again (plain all-gather) when the backward needs it.

Prefetch (`commfuse.parallel.prefetch`, on unless the plan's ``prefetch`` is 0): a
ShardedLinear that the plan gave a `Prefetcher` takes its gathered weight from it: posted
while the previous unit (transformer block) computed, consumed slot by slot (its own rows
first) by the forward GEMM (`_PrefetchedMatmul`), taken again, whole, by the backward. The
backward posts the gradient reduce-scatter and finishes it during the next weight's backward
(``defer_reduce``, set by the plan; the prefetcher's `GradReduce` writes ``.grad``, so
``torch.autograd.grad`` does not see these weights), else it runs the method's fused
GEMM -> RS as without prefetch. Under TP / UP x DP ``gather()`` and `regathered`'s backward
take from the prefetcher too.

The optimizer is sharded by construction: AdamW over the local parameters (each rank updates
only its rows; the replicated norms / embedding are updated identically on every rank, from
identical all-reduced gradients), so its state is sharded like the weights.

Shape suffixes: O rows of W (out), o = O/P this rank's rows, I columns (in), N tokens.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from commfuse.ops import auto
from commfuse.ops.fused import fused_all_gather_matmul
from commfuse.ops.gather_scatter import ag_matmul_backward
from commfuse.ops.methods import method_spec
from commfuse.runtime import modes
from commfuse.runtime.collectives import BACKEND
from commfuse.parallel.config import mark_sharded

_all_gather, _reduce_scatter = BACKEND["all_gather"], BACKEND["reduce_scatter"]


def shard_rows(w_OI: torch.Tensor, group, what: str = "weight") -> torch.Tensor:
    """This rank's rows of ``w_OI`` over ``group`` (a copy); ValueError if not divisible."""
    world, rank = group.size(), group.rank()
    if w_OI.shape[0] % world:
        raise ValueError(f"{what}: {w_OI.shape[0]} rows are not divisible by the DP group "
                         f"size {world}")
    o = w_OI.shape[0] // world
    return w_OI[rank * o:(rank + 1) * o].detach().clone()


def gather_rows(t_oI: torch.Tensor, group) -> torch.Tensor:
    """Plain all-gather of row shards (no autograd): ``[P*o, ...]`` in rank order."""
    out = t_oI.new_empty((group.size() * t_oI.shape[0], *t_oI.shape[1:]))
    _all_gather(out, t_oI.contiguous(), group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """``W = all_gather(W_shard, 0)``; backward ``dW_shard = reduce_scatter(dW, 0)`` (sum)."""

    @staticmethod
    def forward(ctx, w_oI, group, gather=None):
        ctx.group = group
        return gather_rows(w_oI, group) if gather is None else gather.finish()

    @staticmethod
    def backward(ctx, g_OI):
        g = g_OI.contiguous()
        out = g.new_empty((g.shape[0] // ctx.group.size(), *g.shape[1:]))
        _reduce_scatter(out, g, group=ctx.group)
        return out, None, None


class _PrefetchedMatmul(torch.autograd.Function):
    """``Y_OX = all_gather(W_oI, 0) @ X_XI^T`` on a gather already posted (`WeightGather`).

    Forward: row slice p of Y is computed as soon as rank p's rows of W are here, this rank's
    first (their GEMM hides whatever is still travelling); the whole W is dropped after.
    Backward: the whole W is taken again from the prefetcher (posted during the backward of
    the unit after), dX^T = W^T @ dY, and dW_oI = reduce_scatter(dY_OX @ X_XI): with
    ``mod.defer_reduce`` posted first and finished later into ``.grad``
    (`commfuse.parallel.prefetch.GradReduce`; None is returned for W), else the method's
    fused GEMM -> RS (`ag_matmul_backward` on the gathered W). Saved: W_oI, X_XI.
    """

    @staticmethod
    def forward(ctx, w_oI, x_XI, mod, gather, spec):
        y_OX = x_XI.new_empty((gather.full.shape[0], x_XI.shape[0]))
        x_IX = x_XI.t()
        for p in gather.order:  # own rows first: their GEMM hides the others' transfers
            rows = gather.wait(p)
            modes.gemm(gather.full[rows], x_IX, out=y_OX[rows])
        gather.finish()
        ctx.save_for_backward(w_oI, x_XI)
        ctx.mod, ctx.prefetcher, ctx.spec = mod, mod.prefetcher, spec
        return y_OX

    @staticmethod
    def backward(ctx, g_OX):
        w_oI, x_XI = ctx.saved_tensors
        mod, world, pf = ctx.mod, ctx.mod.group.size(), ctx.prefetcher
        if mod.defer_reduce and ctx.needs_input_grad[0]:
            # dW's reduce-scatter posted first (no W needed), finished by the next weight's
            # backward: its transfers overlap the dX GEMM and the backward before it
            pf.reduce_later(mod, g_OX, x_XI)
            w_OI = pf.take(mod, "backward").finish()
            g_xT = modes.gemm(w_OI.t(), g_OX) if ctx.needs_input_grad[1] else None
            return None, None if g_xT is None else g_xT.t(), None, None, None
        w_OI = pf.take(mod, "backward").finish()
        g_w, (g_xT,) = ag_matmul_backward(
            w_OI, [x_XI.t()], None, [g_OX], 0, (w_oI.shape[0],) * world, mod.group, ctx.spec,
            gathered=True, need_a=ctx.needs_input_grad[0], need_bs=[ctx.needs_input_grad[1]])
        return g_w, None if g_xT is None else g_xT.t(), None, None, None


class ShardedLinear(nn.Module):
    """A bias-free Linear whose ``weight`` is this rank's rows over the DP group.

    ``forward(x_NI)`` is the ZeRO-3 fused path (parameter all-gather fused with the GEMM,
    gradient reduce-scatter fused with the weight-grad GEMM). ``gather()`` returns the full
    weight for a TP / UP op that consumes it (plain all-gather, reduce-scatter backward).
    """

    def __init__(self, weight_OI: torch.Tensor, group, op_kwargs: dict, what: str = "weight"):
        super().__init__()
        self.group, self.op_kwargs = group, dict(op_kwargs)
        self.out_features = weight_OI.shape[0]
        self.what = what
        self.weight = mark_sharded(nn.Parameter(shard_rows(weight_OI, group, what)), "dp")

    prefetcher = None  # a commfuse.parallel.prefetch.Prefetcher, set by the plan
    defer_reduce = False  # with it: dW's reduce-scatter finished later (set by the plan)

    def forward(self, x_NI: torch.Tensor) -> torch.Tensor:
        x_XI = x_NI.reshape(-1, x_NI.shape[-1])
        if self._prefetching():  # the weight was posted while the previous unit computed
            kw = dict(self.op_kwargs)
            spec = auto.resolve(method_spec(kw.pop("method", "commfuse"), kw), "ag_matmul",
                                (self.out_features, x_XI.shape[1], x_XI.shape[0]),
                                self.group.size(), x_XI, self.group)
            gather = self.prefetcher.take(self, "forward")
            y_OX = _PrefetchedMatmul.apply(self.weight, x_XI, self, gather, spec)
        else:
            # the gather of the next weight row-slice hides behind the GEMM of the current one
            _, (y_OX,) = fused_all_gather_matmul(self.weight, [x_XI.t()], 0, self.group,
                                                 return_A=False, **self.op_kwargs)
        return y_OX.t().reshape(*x_NI.shape[:-1], self.out_features)

    def gather(self) -> torch.Tensor:
        if self._prefetching():
            return _GatherRows.apply(self.weight, self.group, self.prefetcher.take(self, "forward"))
        return _GatherRows.apply(self.weight, self.group)

    def regather(self) -> torch.Tensor:
        """The whole weight again, for a backward (no autograd; prefetched if posted)."""
        if self._prefetching():
            return self.prefetcher.take(self, "backward").finish()
        return gather_rows(self.weight.detach(), self.group)

    def _prefetching(self) -> bool:
        return (self.prefetcher is not None and self.weight.device.type == "cpu"
                and not torch.compiler.is_compiling())

    def full_grad(self) -> torch.Tensor:
        """The whole weight's gradient (collective over the DP group)."""
        return gather_rows(self.weight.grad, self.group)

    def extra_repr(self) -> str:
        return f"rows {tuple(self.weight.shape)} of {self.out_features}, dp={self.group.size()}"


@contextlib.contextmanager
def regathered(*mods: nn.Module):
    """Yield ``[m.gather() for m in mods]`` for the ops inside; any of those weights (or a view
    of one) saved for backward by an op inside is saved as this rank's shard instead and
    gathered again when the backward unpacks it, so the full weights live only inside.

    Every DP rank unpacks the same saved tensors in the same order (the same graph), so the
    all-gathers of the backward match up. Saved-tensor hooks already in force outside (e.g.
    ``torch.autograd.graph.save_on_cpu``) still apply to every other saved tensor. Under
    torch.compile the weights are saved whole (the hooks are not traced).
    """
    ws = [m.gather() for m in mods]
    owner = {w.untyped_storage().data_ptr(): m for w, m in zip(ws, mods)
             if isinstance(m, ShardedLinear)}
    if not owner or torch.compiler.is_compiling():  # compiled: saved whole (no hooks there)
        yield ws
        return
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)
    outer = top(False)  # (pack, unpack) of the hooks in force, or None

    def pack(t: torch.Tensor):
        m = owner.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if m is not None:
            return (_Regather, m, t.size(), t.stride(), t.storage_offset())
        return t if outer is None else (_Outer, outer[0](t))

    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        if packed[0] is _Outer:
            return outer[1](packed[1])
        _, m, size, stride, offset = packed
        return m.regather().as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield ws


class _Regather:
    """Marks a saved weight packed by `regathered` as its shard."""


class _Outer:
    """Marks a saved tensor packed by the hooks in force outside `regathered`."""


class LocalWeight(nn.Module):
    """A weight held whole on this rank (no DP sharding); same interface as ShardedLinear."""

    def __init__(self, weight_OI: torch.Tensor, *axes: str):
        super().__init__()
        self.weight = mark_sharded(nn.Parameter(weight_OI.detach().clone()), *axes)

    def gather(self) -> torch.Tensor:
        return self.weight

    def full_grad(self) -> torch.Tensor:
        return self.weight.grad


def weight(w_OI: torch.Tensor, dp_group, op_kwargs: dict, what: str, *axes: str) -> nn.Module:
    """``w_OI`` as a module with ``.weight`` / ``.gather()``: DP-sharded if ``dp_group``."""
    if dp_group is None:
        return LocalWeight(w_OI, *axes)
    mod = ShardedLinear(w_OI, dp_group, op_kwargs, what)
    mark_sharded(mod.weight, *axes)
    return mod


def shard_linears(module: nn.Module, dp_group, op_kwargs: dict, prefix: str = "") -> None:
    """Replace every bias-free ``nn.Linear`` under ``module`` by a `ShardedLinear` (in place)."""
    for name, child in list(module.named_children()):
        full = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            if child.bias is not None:
                raise ValueError(f"{full}: Linear with bias is not supported by the DP plan")
            setattr(module, name, ShardedLinear(child.weight, dp_group, op_kwargs, full))
        else:
            shard_linears(child, dp_group, op_kwargs, f"{full}.")

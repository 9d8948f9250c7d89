"""GEMM -> reduce-scatter (TPSP row-parallel linear forward, DP gradient sharding).

    C = reduce_scatter(A @ B, scatter_dim)   (sum, or avg = sum / W)

Legend (suffixes of tensor names): W group size, r this rank, s one rank's slice of the
scattered dim, S = W*s the scattered dim (moved to the front), M the other leading dims,
K the contraction, N output columns. Slot p is the slice rank p keeps, rows [p*s, (p+1)*s).

Internally the GEMM is a sum of terms ``sum_i x_i @ b_i (+ extra)``, so the backward of
all-gather -> GEMM (several weights, plus the gathered input's own gradient) runs as one op.
"""

from __future__ import annotations

import torch

from commfuse import executor
from commfuse.ops import _common
from commfuse.schedule import Transfer


class _ReduceBinding(_common.Binding):
    """Partials per slot (P2P methods) or per chunk (sliced / none), and the result."""

    def __init__(self, partial, shape_sMN, like: torch.Tensor, world: int, rank: int, spec):
        self.partial, self.like, self.world, self.rank = partial, like, world, rank
        self.cut(shape_sMN[0], spec)
        self.shape_sMN = tuple(shape_sMN)
        self.part: dict[int, torch.Tensor] = {}  # slot or chunk -> partial (running) sum
        self.recv: dict[tuple[int, int], torch.Tensor] = {}  # (slot, peer) -> received partial
        self.out_sMN = like.new_empty(self.shape_sMN)

    def result(self) -> torch.Tensor:
        if self.world == 1 and not self.pieces:  # no reduction ran: the partials are the result
            for slot, part in self.part.items():
                self.out_sMN[self.sub_rows(slot)].copy_(part)
        return self.out_sMN

    # P2P methods
    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send":
            return self.part[t.slot]
        r = self.sub_rows(t.slot)
        buf = self.recv[(t.slot, t.peer)] = self.like.new_empty((r.stop - r.start, *self.shape_sMN[1:]))
        return buf

    def compute(self, slot: int) -> None:
        if self.pieces:  # sliced / none: chunk `slot` of every rank's slice
            off, n = self.pieces[slot]
            s = self.s
            self.part[slot] = self.partial(lambda x: x.unflatten(0, (self.world, s))[:, off:off + n])
            return
        rows = self.rows(slot)
        self.part[slot] = self.partial(lambda x: x[rows])

    def reduce(self, slot: int, peers: tuple[int, ...]) -> None:
        """Sum in the schedule's order (the own partial where a peer is this rank); this rank's
        own slots are summed straight into the result."""
        terms = [self.part[slot] if p == self.rank else self.recv.pop((slot, p)) for p in peers]
        own = slot // self.m == self.rank
        acc = torch.add(terms[0], terms[1], out=self.out_sMN[self.sub_rows(slot)] if own else None)
        for t in terms[2:]:
            acc.add_(t)
        self.part[slot] = acc

    # sliced / none
    def collective(self, slot: int, transport):
        off, n = self.pieces[slot]
        return transport.launch("reduce_scatter", self.out_sMN[off:off + n],
                                self.part[slot].flatten(0, 1), slot)

    def collective_done(self, slot: int) -> None:
        del self.part[slot]


def reduce_scatter_of(partial, shape_sMN, like: torch.Tensor, group, spec) -> torch.Tensor:
    """No autograd: ``reduce_scatter(P, 0)`` where ``partial(view)`` computes ``view(P)``.

    ``view`` selects rows of the full ``[S, ...]`` operand (one slot, or one chunk of every
    slot); ``partial`` computes this rank's contribution for exactly those rows, so any
    computation that is row-wise in S (a GEMM, query-split attention) can be fused.
    """
    binding = _ReduceBinding(partial, shape_sMN, like, group.size(), group.rank(), spec)
    _common.execute("matmul_rs", spec, group, binding, like.device)
    return binding.result()


def matmul_rs(terms, extra_SMN, group, spec) -> torch.Tensor:
    """No autograd: ``reduce_scatter(sum_i x_i @ b_i + extra, 0)`` (sum) under ``spec``."""
    x0, b0 = terms[0]

    def partial(view) -> torch.Tensor:
        acc = None
        for x, b in terms:
            y = executor.gemm(view(x), b)
            acc = y if acc is None else acc.add_(y)
        return acc.add_(view(extra_SMN)) if extra_SMN is not None else acc

    shape = (x0.shape[0] // group.size(), *x0.shape[1:-1], b0.shape[1])
    return reduce_scatter_of(partial, shape, x0, group, spec)


class MatmulReduceScatter(torch.autograd.Function):
    """``C = reduce_scatter(A @ B, dim)``, summed (or averaged) over the group.

    Shapes: A [.., W*s, .., K] (W*s at ``dim``), B [K, N] (this rank's row shard);
    returns C [.., s, .., N], this rank's slice.
    Input grad:  dA = all_gather(dC, dim) @ B^T, run as the dual all-gather -> GEMM with the
    same method (dC / W for avg).  Weight grad: dB = A^T @ all_gather(dC, dim).
    Extra memory: ring: one partial and one receive buffer of C's size per step in flight;
    direct: W-1 receive buffers of C's size; sliced/none: the partial GEMM output (W x C).
    """

    @staticmethod
    def forward(ctx, a, b, dim, avg, group, spec):
        c_sMN = matmul_rs([(a.movedim(dim, 0), b)], None, group, spec)
        if avg:
            c_sMN = c_sMN.div_(group.size())
        ctx.save_for_backward(a, b)
        ctx.dim, ctx.avg, ctx.group, ctx.spec = dim, avg, group, spec
        return c_sMN.movedim(0, dim)

    @staticmethod
    def backward(ctx, gc):
        from commfuse.ops.ag_matmul import ag_matmul

        a, b = ctx.saved_tensors
        gc_sMN = gc.movedim(ctx.dim, 0)
        if ctx.avg:
            gc_sMN = gc_sMN / ctx.group.size()
        gc_SMN, (ga_SMK,) = ag_matmul(gc_sMN, [b.t()], ctx.group, ctx.spec)
        gb = None
        if ctx.needs_input_grad[1]:
            gb = a.movedim(ctx.dim, 0).flatten(0, -2).t() @ gc_SMN.flatten(0, -2)
        return ga_SMK.movedim(0, ctx.dim), gb, None, None, None, None

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
import torch.distributed as dist

from commfuse.ops import _common
from commfuse.schedule import Transfer

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ReduceBinding:
    """Partials per slot (P2P methods) or per chunk (sliced / none), and the result."""

    def __init__(self, terms, extra_SMN, world: int, rank: int, spec):
        self.terms, self.extra, self.world, self.rank = terms, extra_SMN, world, rank
        x0 = terms[0][0]
        self.s = s = x0.shape[0] // world
        self.shape_sMN = (s, *x0.shape[1:-1], terms[0][1].shape[1])
        self.part: dict[int, torch.Tensor] = {}  # slot or chunk -> partial sum
        self.recv: dict[tuple[int, int], torch.Tensor] = {}  # (slot, peer) -> received partial
        self.pieces = None
        if spec.method in ("none", "sliced"):
            self.pieces = _common.split(s, 1 if spec.method == "none" else min(spec.chunks, max(s, 1)))
            self.out_sMN = x0.new_empty(self.shape_sMN)

    def chunks(self, spec) -> int:
        return len(self.pieces) if self.pieces else self.world

    def partial(self, view) -> torch.Tensor:
        """``sum_i view(x_i) @ b_i (+ view(extra))``: this rank's GEMM on a part of S."""
        acc = None
        for x, b in self.terms:
            y = torch.matmul(view(x), b)
            acc = y if acc is None else acc.add_(y)
        if self.extra is not None:
            acc = acc.add_(view(self.extra)) if acc is not None else view(self.extra).clone()
        return acc

    def result(self) -> torch.Tensor:
        return self.out_sMN if self.pieces else self.part[self.rank]

    # P2P methods
    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send":
            return self.part[t.slot]
        buf = self.recv[(t.slot, t.peer)] = self.terms[0][0].new_empty(self.shape_sMN)
        return buf

    def compute(self, slot: int) -> None:
        if self.pieces:  # sliced / none: chunk `slot` of every rank's slice
            off, n = self.pieces[slot]
            s = self.s
            self.part[slot] = self.partial(lambda x: x.unflatten(0, (self.world, s))[:, off:off + n])
            return
        self.part[slot] = self.partial(lambda x: x[slot * self.s:(slot + 1) * self.s])

    def reduce(self, slot: int, peers: tuple[int, ...]) -> None:
        """Sum in the schedule's order: the own partial where a peer is this rank."""
        terms = [self.part[slot] if p == self.rank else self.recv.pop((slot, p)) for p in peers]
        acc = terms[0] + terms[1]
        for t in terms[2:]:
            acc.add_(t)
        self.part[slot] = acc

    # sliced / none
    def collective(self, slot: int, transport):
        off, n = self.pieces[slot]
        return transport.launch(_reduce_scatter, self.out_sMN[off:off + n],
                                self.part[slot].flatten(0, 1))

    def collective_done(self, slot: int) -> None:
        del self.part[slot]


def matmul_rs(terms, extra_SMN, group, spec) -> torch.Tensor:
    """No autograd: ``reduce_scatter(sum_i x_i @ b_i + extra, 0)`` (sum) under ``spec``."""
    binding = _ReduceBinding(terms, extra_SMN, group.size(), group.rank(), spec)
    _common.execute("matmul_rs", spec, group, binding, terms[0][0].device)
    return binding.result()


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

"""GEMM -> reduce-scatter (TPSP row-parallel linear forward, DP gradient sharding).

    C = reduce_scatter(A @ B, scatter_dim)   (sum, or avg = sum / W)

Legend (suffixes of tensor names): W group size, r this rank, s one rank's slice of the
scattered dim, S the scattered dim (moved to the front; W*s when the slices are even), M the
other leading dims, K the contraction, N output columns. Slot p is the slice rank p keeps.

Internally the GEMM is a sum of terms ``sum_i x_i @ b_i (+ extra)``, so the backward of
all-gather -> GEMM (several weights, plus the gathered input's own gradient) runs as one op.
"""

from __future__ import annotations

import torch

from commfuse.ops.binding import Binding, execute
from commfuse.runtime import modes
from commfuse.schedule import Transfer


class _ReduceBinding(Binding):
    """Partials per slot (P2P methods) or per chunk (sliced / none), and the result."""

    def __init__(self, partial, sizes, shape_MN, like: torch.Tensor, world: int, rank: int, spec):
        self.partial, self.like, self.world, self.rank = partial, like, world, rank
        self.cut(sizes, spec)
        self.shape_sMN = (self.s, *shape_MN)
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
            self.part[slot] = self.flat(self.partial(lambda x: self.chunk_rows(x, slot)))
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
        off, n = self.piece(slot)
        return transport.launch("reduce_scatter", self.out_sMN[off:off + n], self.part[slot],
                                slot, sizes=self.chunk_sizes(slot))

    def collective_done(self, slot: int) -> None:
        del self.part[slot]


def reduce_scatter_of(partial, sizes, shape_MN, like: torch.Tensor, group, spec) -> torch.Tensor:
    """No autograd: ``reduce_scatter(P, 0)`` -> ``[sizes[rank], *shape_MN]``, where
    ``partial(view)`` computes ``view(P)``.

    ``view`` selects rows of the full ``[S, ...]`` operand (one slot, or one chunk of every
    slot); ``partial`` computes this rank's contribution for exactly those rows, so any
    computation that is row-wise in S (a GEMM, query-split attention) can be fused. Its result
    keeps the view's leading dims (``[W, n, ...]`` for an even chunk).
    """
    binding = _ReduceBinding(partial, sizes, shape_MN, like, group.size(), group.rank(), spec)
    execute("matmul_rs", spec, group, binding, like.device)
    return binding.result()


def matmul_rs(terms, extra_SMN, sizes, group, spec) -> torch.Tensor:
    """No autograd: ``reduce_scatter(sum_i x_i @ b_i + extra, 0)`` (sum) under ``spec``; rank p
    keeps ``sizes[p]`` rows."""
    x0, b0 = terms[0]

    def partial(view) -> torch.Tensor:
        acc = None
        for x, b in terms:
            y = modes.gemm(view(x), b)
            acc = y if acc is None else acc.add_(y)
        return acc.add_(view(extra_SMN)) if extra_SMN is not None else acc

    return reduce_scatter_of(partial, sizes, (*x0.shape[1:-1], b0.shape[1]), x0, group, spec)

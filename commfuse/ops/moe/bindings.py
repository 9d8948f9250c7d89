"""The MoE ops' bindings: what each slot of a `commfuse.schedule.moe` schedule reads, writes
and computes, and `dispatch_matmul` / `matmul_combine`, which run one schedule without
autograd (`commfuse.ops.moe.autograd` wraps them in autograd Functions).

Legend as in `commfuse.ops.moe.autograd`: T rows of this rank's send layout, R rows of its
receive layout, E its local experts, K the contraction, N the output columns.
"""

from __future__ import annotations

import torch

from commfuse.ops.methods import MethodSpec
from commfuse.ops.moe.gemm import grouped
from commfuse.runtime import executor
from commfuse.schedule import Transfer
from commfuse.schedule import moe as moe_schedule
from commfuse.schedule.moe import TAIL, ExpertCounts, clip, piece


class _Slots:
    """What both bindings share: this rank's slots in the two layouts, and the chunks.
    ``k``: none/sliced's chunks, else None (commfuse: slot p*m + j is piece j of slot p);
    ``tail``: what ``Compute(TAIL)`` runs (`commfuse.schedule.moe.build`'s ``tail``)."""

    def __init__(self, counts: ExpertCounts, rank: int, k: int | None, m: int = 1, tail=None):
        self.counts, self.rank, self.k, self.m, self.tail = counts, rank, k, m, tail
        self.to = counts.rows[rank]  # rows of my send-layout slot q (mine for / from rank q)
        self.of = tuple(row[rank] for row in counts.rows)  # rows of my receive-layout slot p
        self.soff, self.roff = counts.send_offsets(rank), counts.recv_offsets(rank)

    def send_rows(self, q: int) -> slice:
        return slice(self.soff[q], self.soff[q] + self.to[q])

    def recv_rows(self, p: int) -> slice:
        return slice(self.roff[p], self.roff[p] + self.of[p])

    def pieces(self, sizes, j: int) -> list[tuple[int, int]]:
        """(offset in its slot, rows) of chunk j of each slot of ``sizes``."""
        return [piece(n, self.k, j) for n in sizes]

    def split(self, slot: int, sizes) -> tuple[int, int, int]:
        """commfuse: (slot p, offset in it, rows) of P2P slot p*m + j of ``sizes``."""
        p, j = divmod(slot, self.m)
        return (p, *piece(sizes[p], self.m, j))

    def gemm(self, x_RK, w_EKN, out_RN, p: int, lo: int, hi: int, at: int) -> None:
        """Rows [lo, hi) of receive slot p of ``x_RK`` times their experts' weights, into
        ``out_RN`` from row ``at``."""
        if hi > lo:
            base = self.roff[p]
            grouped(x_RK[base + lo:base + hi], w_EKN, clip(self.counts.groups(p, self.rank), lo, hi),
                    out_RN[at:at + hi - lo])

    def reduce(self, slot, peers):
        raise AssertionError("the MoE schedules have no reduction")


class _Dispatch(_Slots):
    """dispatch -> GEMM: rank p's slot for me lands in ``x_RK`` (receive layout), then
    ``y_RN[group (p, e)] = x_RK[group] @ w_EKN[e]``."""

    def __init__(self, x_TK, w_EKN, counts, rank, k, m=1, tail=None):
        super().__init__(counts, rank, k, m, tail)
        self.x, self.w = x_TK, w_EKN
        rows = sum(self.of)
        self.x_RK = x_TK.new_empty((rows, x_TK.shape[1]))
        self.y_RN = x_TK.new_empty((rows, w_EKN.shape[2]))
        self.landed: dict[int, torch.Tensor] = {}

    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send":
            q, off, n = self.split(t.slot, self.to)
            return self.x[self.soff[q] + off:self.soff[q] + off + n]
        p, off, n = self.split(t.slot, self.of)
        return self.x_RK[self.roff[p] + off:self.roff[p] + off + n]

    def compute(self, slot: int) -> None:
        if slot == TAIL:
            self.tail_out = self.tail(self)
            return
        if self.k is None:  # piece j of the source rank p's slot
            p, off, n = self.split(slot, self.of)
            if p == self.rank:  # own tokens: already here
                self.x_RK[self.roff[p] + off:self.roff[p] + off + n] = \
                    self.x[self.soff[p] + off:self.soff[p] + off + n]
            self.gemm(self.x_RK, self.w, self.y_RN, p, off, off + n, self.roff[p] + off)
            return
        for p, (off, n) in enumerate(self.pieces(self.of, slot)):  # chunk j of every slot
            self.gemm(self.x_RK, self.w, self.y_RN, p, off, off + n, self.roff[p] + off)

    def collective(self, j: int, transport):
        if self.k == 1:  # none: every slot at once, straight into the receive layout
            return transport.launch("all_to_all", self.x_RK, self.x, j, sizes=list(self.of),
                                    in_sizes=list(self.to))
        sends = self.pieces(self.to, j)
        inp = torch.cat([self.x[self.soff[q] + off:self.soff[q] + off + n]
                         for q, (off, n) in enumerate(sends)])
        recvs = [n for _, n in self.pieces(self.of, j)]
        out = self.landed[j] = inp.new_empty((sum(recvs), inp.shape[1]))
        return transport.launch("all_to_all", out, inp, j, sizes=recvs,
                                in_sizes=[n for _, n in sends])

    def collective_done(self, j: int) -> None:
        if self.k == 1:
            return
        out, at = self.landed.pop(j), 0
        for p, (off, n) in enumerate(self.pieces(self.of, j)):
            self.x_RK[self.roff[p] + off:self.roff[p] + off + n] = out[at:at + n]
            at += n


class _Combine(_Slots):
    """GEMM -> combine: ``a_RK[group (p, e)] @ w_EKN[e]`` for each source p, sent back to p;
    the rows rank q computed for me land in my send layout ``y_TN``."""

    def __init__(self, a_RK, w_EKN, counts, rank, k, m=1, tail=None):
        super().__init__(counts, rank, k, m, tail)
        self.a, self.w = a_RK, w_EKN
        self.y_TN = a_RK.new_empty((sum(self.to), w_EKN.shape[2]))
        self.part: dict[int, torch.Tensor] = {}  # commfuse: per destination; else per chunk
        self.landed: dict[int, torch.Tensor] = {}

    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send":
            return self.part[t.slot]
        q, off, n = self.split(t.slot, self.to)
        return self.y_TN[self.soff[q] + off:self.soff[q] + off + n]

    def compute(self, slot: int) -> None:
        if slot == TAIL:
            self.tail_out = self.tail(self)
            return
        if self.k is None:  # piece j of the rows for rank p (its tokens, back to it)
            p, off, n = self.split(slot, self.of)
            own = p == self.rank
            out = self.y_TN[self.soff[p] + off:self.soff[p] + off + n] if own else \
                self.a.new_empty((n, self.w.shape[2]))
            self.gemm(self.a, self.w, out, p, off, off + n, 0)
            if not own:
                self.part[slot] = out
            return
        pieces = self.pieces(self.of, slot)
        out = self.part[slot] = self.a.new_empty((sum(n for _, n in pieces), self.w.shape[2]))
        at = 0
        for p, (off, n) in enumerate(pieces):  # chunk j of every source slot, source order
            self.gemm(self.a, self.w, out, p, off, off + n, at)
            at += n

    def collective(self, j: int, transport):
        recvs = self.pieces(self.to, j)
        out = self.y_TN if self.k == 1 else self.a.new_empty(
            (sum(n for _, n in recvs), self.w.shape[2]))
        self.landed[j] = out
        return transport.launch("all_to_all", out, self.part[j], j,
                                sizes=[n for _, n in recvs],
                                in_sizes=[n for _, n in self.pieces(self.of, j)])

    def collective_done(self, j: int) -> None:
        del self.part[j]
        out, at = self.landed.pop(j), 0
        if out is self.y_TN:
            return
        for q, (off, n) in enumerate(self.pieces(self.to, j)):
            self.y_TN[self.soff[q] + off:self.soff[q] + off + n] = out[at:at + n]
            at += n


def _run(op: str, binding_cls, a, w, counts, group, spec: MethodSpec, tail=None):
    """Run ``op``'s schedule; ``tail(binding)``, if given, runs once its last GEMM is done
    (before the final waits, `commfuse.schedule.moe.TAIL`; after the collective under none),
    its result in ``binding.tail_out``."""
    m = spec.splits or 1 if spec.method == "commfuse" else 1
    schedule = moe_schedule.build(op, spec.method, counts, group.rank(), chunks=spec.chunks,
                                  splits=m, tail=tail is not None)
    k = None if spec.method == "commfuse" else schedule.chunks
    binding = binding_cls(a.contiguous(), w, counts, group.rank(), k, m, tail)
    binding.tail_out = None
    executor.run(schedule, binding,
                 executor.make_transport(group, a.device, spec.timeout, spec.collective))
    if tail is not None and moe_schedule.TAIL not in schedule.computes():
        binding.tail_out = tail(binding)
    return binding


def dispatch_matmul(x_TK, w_EKN, counts, group, spec, tail=None):
    """No autograd: ``(dispatch(x_TK) @ w_EKN[e] -> y_RN, the received rows x_RK, what
    ``tail(binding)`` returned)``."""
    binding = _run("moe_dispatch", _Dispatch, x_TK, w_EKN, counts, group, spec, tail)
    return binding.y_RN, binding.x_RK, binding.tail_out


def matmul_combine(a_RK, w_EKN, counts, group, spec, tail=None):
    """No autograd: ``(combine(a_RK @ w_EKN[e]) -> y_TN, what ``tail(binding)`` returned)``."""
    binding = _run("moe_combine", _Combine, a_RK, w_EKN, counts, group, spec, tail)
    return binding.y_TN, binding.tail_out

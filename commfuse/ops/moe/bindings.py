"""The MoE ops' bindings: what each slot of a `commfuse.schedule.moe` schedule reads, writes
and computes, and `dispatch_matmul` / `matmul_combine`, which run one schedule without
autograd (`commfuse.ops.moe.autograd` wraps them in autograd Functions).

Legend as in `commfuse.ops.moe.autograd`: T rows of this rank's send layout (its moved rows:
one per (token, destination rank) with dedup), U rows moved to this rank (its receive slots
as they travel), R rows of its expanded receive layout (one per (token, expert), what the
GEMMs run on), E its local experts, K the contraction, N the output columns. Without dedup
U and R are the same rows and no gather or sum runs.
"""

from __future__ import annotations

import torch

from commfuse.ops.methods import MethodSpec
from commfuse.ops.moe.gemm import device_ints, ends, grouped
from commfuse.runtime import executor
from commfuse.schedule import Transfer
from commfuse.schedule import moe as moe_schedule
from commfuse.schedule.moe import TAIL, ExpertCounts, clip, piece
from commfuse.schedule.expert_counts import starts


class _Slots:
    """What both bindings share: this rank's slots in the layouts, and the chunks.
    ``k``: none/sliced's chunks, else None (commfuse: slot p*m + j is piece j of slot p);
    ``tail``: what ``Compute(TAIL)`` runs (`commfuse.schedule.moe.build`'s ``tail``);
    ``routing``: the step's `commfuse.ops.moe.routing.Routing` (dedup), else None."""

    def __init__(self, op: str, counts: ExpertCounts, rank: int, k: int | None, m: int,
                 tail, routing, device):
        self.op, self.counts, self.rank, self.k, self.m, self.tail = op, counts, rank, k, m, tail
        self.routing = routing
        w = counts.world
        self.of = tuple(row[rank] for row in counts.rows)  # expanded rows of receive slot p
        self.roff = counts.recv_offsets(rank)
        self.u_to = counts.pairs[rank]  # moved rows of my send slot q (mine for / from q)
        self.u_of = tuple(row[rank] for row in counts.pairs)  # moved rows of receive slot p
        self.usoff, self.uroff = starts(self.u_to), starts(self.u_of)
        n = k or m
        # every GEMM's group ends in one copy to the device: (p, j) -> (sizes, offs)
        self.groups, flat, at = {}, [], []
        for p in range(w):
            for j in range(n):
                lo, rows = piece(self.of[p], n, j)
                sizes = clip(counts.groups(p, rank), lo, lo + rows)
                self.groups[p, j] = sizes
                if sum(1 for s in sizes if s) > 1:
                    at.append((p, j, len(flat)))
                    flat += ends(sizes)
        offs = device_ints(flat, device) if flat else None
        self.offs = {(p, j): offs[i:i + counts.local] for p, j, i in at}

    def moved(self, p: int, q: int, j: int, n: int | None = None) -> tuple[int, int]:
        """(offset, rows) in slot (p -> q)'s moved rows of chunk j (of ``n``, default m)."""
        return self.counts.moved_piece(self.op, p, q, n or self.m, j)

    def split(self, slot: int) -> tuple[int, int]:
        """commfuse: (slot p, piece j) of P2P slot p*m + j."""
        return divmod(slot, self.m)

    def gemm(self, x_RK, w_EKN, out_RN, p: int, j: int, at: int) -> None:
        """Chunk j of receive slot p of ``x_RK`` times its experts' weights, into ``out_RN``
        from row ``at``."""
        lo, n = piece(self.of[p], self.k or self.m, j)
        if n:
            base = self.roff[p] + lo
            grouped(x_RK[base:base + n], w_EKN, self.groups[p, j], out_RN[at:at + n],
                    self.offs.get((p, j)))

    def reduce(self, slot, peers):
        raise AssertionError("the MoE schedules have no reduction")


class _Dispatch(_Slots):
    """dispatch -> GEMM: rank p's slot for me lands in ``x_UK``, is expanded to ``x_RK``
    (with dedup: each expanded row's token, `Routing.src_first`), then
    ``y_RN[group (p, e)] = x_RK[group] @ w_EKN[e]``. ``scale`` (weights [R], raw [R, N]):
    each expanded row g becomes ``(g * weight)`` before its GEMM and ``gweights`` gets
    ``g . raw`` (the weighted sum's backward, `commfuse.ops.moe.autograd.MatmulCombine`)."""

    def __init__(self, x_TK, w_EKN, counts, rank, k, m=1, tail=None, routing=None, scale=None):
        super().__init__("moe_dispatch", counts, rank, k, m, tail, routing, x_TK.device)
        self.x, self.w, self.scale = x_TK, w_EKN, scale
        rows = sum(self.of)
        self.x_RK = x_TK.new_empty((rows, x_TK.shape[1]))
        self.x_UK = self.x_RK if routing is None else x_TK.new_empty((sum(self.u_of),
                                                                       x_TK.shape[1]))
        self.y_RN = x_TK.new_empty((rows, w_EKN.shape[2]))
        self.gweights = None if scale is None else scale[0].new_empty(rows)
        self.landed: dict[int, torch.Tensor] = {}

    def buffer(self, t: Transfer) -> torch.Tensor:
        q, j = self.split(t.slot)
        if t.kind == "send":
            off, n = self.moved(self.rank, q, j)
            return self.x[self.usoff[q] + off:self.usoff[q] + off + n]
        off, n = self.moved(q, self.rank, j)
        return self.x_UK[self.uroff[q] + off:self.uroff[q] + off + n]

    def compute(self, slot: int) -> None:
        if slot == TAIL:
            self.tail_out = self.tail(self)
            return
        if self.k is None:  # piece j of the source rank p's slot
            p, j = self.split(slot)
            if p == self.rank:  # own tokens: already here
                off, n = self.moved(p, p, j)
                self.x_UK[self.uroff[p] + off:self.uroff[p] + off + n] = \
                    self.x[self.usoff[p] + off:self.usoff[p] + off + n]
            self.expand(p, j)
            self.gemm(self.x_RK, self.w, self.y_RN, p, j, self.roff[p] + piece(
                self.of[p], self.m, j)[0])
            return
        for p in range(len(self.of)):  # chunk j of every slot
            self.expand(p, slot)
            self.gemm(self.x_RK, self.w, self.y_RN, p, slot, self.roff[p] + piece(
                self.of[p], self.k, slot)[0])

    def expand(self, p: int, j: int) -> None:
        """Chunk j of slot p's expanded rows from the moved rows (dedup; earlier chunks of
        the slot brought every token it repeats), scaled if ``scale``."""
        if self.routing is None:
            return
        lo, n = piece(self.of[p], self.k or self.m, j)
        if not n:
            return
        rows = slice(self.roff[p] + lo, self.roff[p] + lo + n)
        g = self.x_RK[rows]
        torch.index_select(self.x_UK, 0, self.routing.src_first[rows], out=g)
        if self.scale is not None:
            weights, raw = self.scale[0][rows], self.scale[1][rows]
            wide = torch.promote_types(g.dtype, weights.dtype)
            self.gweights[rows] = (g.to(wide) * raw.to(wide)).sum(-1).to(weights.dtype)
            g.copy_(g.to(wide) * weights.unsqueeze(-1))

    def collective(self, j: int, transport):
        w = len(self.of)
        if self.k == 1:  # none: every slot at once, straight into the receive layout
            return transport.launch("all_to_all", self.x_UK, self.x, j, sizes=list(self.u_of),
                                    in_sizes=list(self.u_to))
        sends = [self.moved(self.rank, q, j, self.k) for q in range(w)]
        inp = torch.cat([self.x[self.usoff[q] + off:self.usoff[q] + off + n]
                         for q, (off, n) in enumerate(sends)])
        recvs = [self.moved(p, self.rank, j, self.k)[1] for p in range(w)]
        out = self.landed[j] = inp.new_empty((sum(recvs), inp.shape[1]))
        return transport.launch("all_to_all", out, inp, j, sizes=recvs,
                                in_sizes=[n for _, n in sends])

    def collective_done(self, j: int) -> None:
        if self.k == 1:
            return
        out, at = self.landed.pop(j), 0
        for p in range(len(self.of)):
            off, n = self.moved(p, self.rank, j, self.k)
            self.x_UK[self.uroff[p] + off:self.uroff[p] + off + n] = out[at:at + n]
            at += n


class _Combine(_Slots):
    """GEMM -> combine: ``a_RK[group (p, e)] @ w_EKN[e]`` for each source p, sent back to p;
    the rows rank q computed for me land in my send layout ``y_TN``. With dedup each
    token's rows are summed first (times ``weights`` [R] if given, each product cast to the
    rows' dtype, in top-k order: `Routing.gather_last`), one row per token sent once its
    last row is computed; ``raw`` keeps the unweighted GEMM rows."""

    def __init__(self, a_RK, w_EKN, counts, rank, k, m=1, tail=None, routing=None,
                 weights=None):
        super().__init__("moe_combine", counts, rank, k, m, tail, routing, a_RK.device)
        self.a, self.w, self.weights = a_RK, w_EKN, weights
        self.y_TN = a_RK.new_empty((sum(self.u_to), w_EKN.shape[2]))
        self.raw = self.prod = None
        if routing is not None:  # the GEMM rows, and a zero row the padded sums point at
            rows = sum(self.of)
            self.raw = a_RK.new_empty((rows + 1, w_EKN.shape[2]))
            self.raw[rows].zero_()
            self.prod = self.raw if weights is None else torch.empty_like(self.raw)
            self.prod[rows].zero_()
        self.part: dict[int, torch.Tensor] = {}  # commfuse: per destination; else per chunk
        self.landed: dict[int, torch.Tensor] = {}

    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send":
            return self.part[t.slot]
        q, j = self.split(t.slot)
        off, n = self.moved(self.rank, q, j)
        return self.y_TN[self.usoff[q] + off:self.usoff[q] + off + n]

    def rows_for(self, p: int, j: int, out: torch.Tensor | None) -> torch.Tensor:
        """Chunk j of source p's rows computed (and, with dedup, summed per token): into
        ``out`` if given (no dedup), else a new tensor."""
        lo, n = piece(self.of[p], self.k or self.m, j)
        if self.routing is None:
            out = self.a.new_empty((n, self.w.shape[2])) if out is None else out
            self.gemm(self.a, self.w, out, p, j, 0)
            return out
        rows = slice(self.roff[p] + lo, self.roff[p] + lo + n)
        self.gemm(self.a, self.w, self.raw, p, j, rows.start)
        if self.weights is not None and n:
            self.prod[rows] = self.raw[rows] * self.weights[rows].unsqueeze(-1)
        off, u = self.moved(p, self.rank, j, self.k or self.m)
        at = self.uroff[p] + off
        return self.prod[self.routing.gather_last[at:at + u]].sum(1)

    def compute(self, slot: int) -> None:
        if slot == TAIL:
            self.tail_out = self.tail(self)
            return
        if self.k is None:  # piece j of the rows for rank p (its tokens, back to it)
            p, j = self.split(slot)
            own = p == self.rank
            off, n = self.moved(p, self.rank, j)
            mine = self.y_TN[self.usoff[p] + off:self.usoff[p] + off + n] if own else None
            out = self.rows_for(p, j, mine if self.routing is None else None)
            if own and self.routing is not None:
                mine.copy_(out)
            elif not own and n:
                self.part[slot] = out
            return
        parts = [self.rows_for(p, slot, None) for p in range(len(self.of))]
        self.part[slot] = torch.cat(parts)  # chunk j of every source slot, source order

    def collective(self, j: int, transport):
        w = len(self.of)
        recvs = [self.moved(self.rank, q, j, self.k)[1] for q in range(w)]
        out = self.y_TN if self.k == 1 else self.a.new_empty((sum(recvs), self.w.shape[2]))
        self.landed[j] = out
        return transport.launch("all_to_all", out, self.part[j], j, sizes=recvs,
                                in_sizes=[self.moved(p, self.rank, j, self.k)[1]
                                          for p in range(w)])

    def collective_done(self, j: int) -> None:
        del self.part[j]
        out, at = self.landed.pop(j), 0
        if out is self.y_TN:
            return
        for q in range(len(self.of)):
            off, n = self.moved(self.rank, q, j, self.k)
            self.y_TN[self.usoff[q] + off:self.usoff[q] + off + n] = out[at:at + n]
            at += n


def _run(op: str, binding_cls, a, w, counts, group, spec: MethodSpec, tail=None, **extra):
    """Run ``op``'s schedule; ``tail(binding)``, if given, runs once its last GEMM is done
    (before the final waits, `commfuse.schedule.moe.TAIL`; after the collective under none),
    its result in ``binding.tail_out``."""
    m = spec.splits or 1 if spec.method == "commfuse" else 1
    schedule = moe_schedule.build(op, spec.method, counts, group.rank(), chunks=spec.chunks,
                                  splits=m, tail=tail is not None)
    k = None if spec.method == "commfuse" else schedule.chunks
    binding = binding_cls(a.contiguous(), w, counts, group.rank(), k, m, tail, **extra)
    binding.tail_out = None
    executor.run(schedule, binding,
                 executor.make_transport(group, a.device, spec.timeout, spec.collective))
    if tail is not None and moe_schedule.TAIL not in schedule.computes():
        binding.tail_out = tail(binding)
    return binding


def dispatch_matmul(x_TK, w_EKN, counts, group, spec, tail=None, routing=None, scale=None):
    """No autograd: ``(dispatch(x_TK) @ w_EKN[e] -> y_RN, the expanded rows x_RK, what
    ``tail(binding)`` returned, the weights' grads if ``scale``)``."""
    b = _run("moe_dispatch", _Dispatch, x_TK, w_EKN, counts, group, spec, tail,
             routing=routing, scale=scale)
    return b.y_RN, b.x_RK, b.tail_out, b.gweights


def matmul_combine(a_RK, w_EKN, counts, group, spec, tail=None, routing=None, weights=None):
    """No autograd: ``(combine(a_RK @ w_EKN[e]) -> y_TN, what ``tail(binding)`` returned,
    the unweighted GEMM rows [R + 1, N] with dedup)``."""
    b = _run("moe_combine", _Combine, a_RK, w_EKN, counts, group, spec, tail,
             routing=routing, weights=weights)
    return b.y_TN, b.tail_out, b.raw


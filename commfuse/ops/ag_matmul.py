"""All-gather -> GEMM (TPSP column-parallel linear forward, ZeRO-3 parameter gather).

    A = all_gather(A_shard, gather_dim);  Y_i = A @ B_i

Legend (suffixes of tensor names): W group size, r this rank, s one rank's slice of the
gathered dim, S the gathered dim (moved to the front; W*s when the slices are even), M the
other leading dims, K the contraction, N a GEMM's output columns. Slot p is rank p's slice.
"""

from __future__ import annotations

import dataclasses

import torch

from commfuse.ops.binding import Binding, build, execute
from commfuse.runtime import executor, modes
from commfuse.schedule import Transfer
from commfuse.schedule.prefetch import prefetch_plan


class _GatherBinding(Binding):
    """The buffers of one call: the gathered ``a_SMK`` (returned too) and the outputs; an
    optional ``consume(view, a_rows)`` runs after each slot's (chunk's) GEMMs on the rows that
    just arrived, ``view(x)`` selecting the same rows of any ``[S, ...]`` tensor ``x``."""

    def __init__(self, a_sMK: torch.Tensor, bs_KN, sizes, world: int, rank: int, spec,
                 consume=None):
        self.a_sMK, self.bs_KN, self.world, self.rank = a_sMK, bs_KN, world, rank
        self.consume = consume
        self.cut(sizes, spec)
        self.a_SMK = a_sMK.new_empty((self.total, *a_sMK.shape[1:]))
        self.ys_SMN = [a_sMK.new_empty((self.total, *a_sMK.shape[1:-1], b.shape[1]))
                       for b in bs_KN]
        self.gathered: dict[int, torch.Tensor] = {}

    # P2P methods: a sub-slice of the gathered buffer travels, and is computed on in place.
    # This rank's own sub-slices are sent from the input itself and copied into the gathered
    # buffer only by their own compute step, so nothing stands before the first post.
    def _own(self, slot: int) -> bool:
        return slot // self.m == self.rank

    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send" and self._own(t.slot):
            return self.a_sMK[self.sub_rows(t.slot)]
        return self.a_SMK[self.rows(t.slot)]

    def compute(self, slot: int) -> None:
        if self.pieces:
            return self._compute_chunk(slot)
        rows = self.rows(slot)
        if self._own(slot):
            self.a_SMK[rows].copy_(self.a_sMK[self.sub_rows(slot)])
        for b_KN, y_SMN in zip(self.bs_KN, self.ys_SMN):
            modes.gemm(self.a_SMK[rows], b_KN, out=y_SMN[rows])
        if self.consume is not None:
            self.consume(lambda x: x[rows], self.a_SMK[rows])

    # sliced / none: all_gather chunk j (rows pieces[p][j] of every slice), then its GEMMs
    def collective(self, slot: int, transport):
        off, n = self.piece(slot)
        out = self.a_SMK if self.whole else self.a_sMK.new_empty(
            (sum(self.chunk_sizes(slot)), *self.a_sMK.shape[1:]))
        self.gathered[slot] = out
        return transport.launch("all_gather", out, self.a_sMK[off:off + n], slot,
                                sizes=self.chunk_sizes(slot))

    def collective_done(self, slot: int) -> None:
        if not self.whole:
            self.place(self.a_SMK, slot, self.gathered[slot])

    def _compute_chunk(self, slot: int) -> None:
        a = self.gathered.pop(slot)
        for b_KN, y_SMN in zip(self.bs_KN, self.ys_SMN):
            if self.whole:
                modes.gemm(a, b_KN, out=y_SMN)
            else:
                self.place(y_SMN, slot, modes.gemm(a, b_KN))
        if self.consume is not None:  # a: chunk `slot` of every slice, in rank order
            self.consume(lambda x: self.flat(self.chunk_rows(x, slot)), a)


def ag_matmul(a_sMK: torch.Tensor, bs_KN, sizes, group, spec, consume=None,
              after_posts=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """No autograd: ``(all_gather(a_sMK, 0), [A @ b for b in bs_KN])`` under ``spec``; rank p's
    slice has ``sizes[p]`` rows. ``consume(view, a_rows)``, if given, is more compute fed by
    the gather: it runs on each slot's (chunk's) rows of A right after their GEMMs, so the
    transfers hide behind it too (the backward's weight-gradient GEMMs, `SlotGEMMs`).
    ``after_posts()``, if given, runs right after the schedule's last post (where a backward
    posts the next op's prefetch, `commfuse.ops.prefetch`)."""
    binding = _GatherBinding(a_sMK.contiguous(), bs_KN, sizes, group.size(), group.rank(), spec,
                             consume)
    execute("ag_matmul", spec, group, binding, a_sMK.device, after_posts)
    return binding.a_SMK, binding.ys_SMN


class PostedGather:
    """``all_gather(a_sMK, 0)`` posted ahead (`commfuse.schedule.prefetch.prefetch_plan`): the
    schedule's early steps (every transfer that needs only this rank's slice) run now, the rest in
    `finish`, with the ``consume`` of the op that uses it; `abandon` waits out what was posted
    instead. P2P methods gather over the direct topology (every transfer early: the ring's
    forwards would wait for their arrival); the slots are computed in the same order either
    way. ``tag_offset`` moves its P2P tags out of the ops' own range."""

    def __init__(self, a_sMK: torch.Tensor, sizes, group, spec, tag_offset: int = 0):
        if spec.method in ("decompose", "commfuse"):
            spec = dataclasses.replace(spec, topology="direct")
        self.binding = _GatherBinding(a_sMK.contiguous(), [], sizes, group.size(), group.rank(),
                                      spec)
        self.plan = prefetch_plan(build("ag_matmul", spec, group, self.binding))
        transport = executor.make_transport(group, a_sMK.device, spec.timeout, spec.collective)
        self.execution = executor.Execution(self.plan.gather, self.binding,
                                            executor.Retagged(transport, tag_offset))
        self.execution.run(self.plan.early)

    def finish(self, consume=None) -> torch.Tensor:
        """Run the rest (waits and ``consume`` per slot, in the op's slot order); the gathered A."""
        self.binding.consume = consume
        self.execution.run(self.plan.late)
        self.execution.close()
        return self.binding.a_SMK

    def abandon(self) -> None:
        """Wait for every posted transfer (deadline), compute nothing."""
        self.execution.drain()


class SlotGEMMs:
    """``out_i = X_i^T @ Z_i`` summed slot by slot over the gathered dim, as `ag_matmul`'s
    ``consume``: the arriving rows of A are ``X`` (``arriving="lhs"``, ``Z_i = fixed[i]``) or
    ``Z`` (``arriving="rhs"``, ``X_i = fixed[i]``); the other operands are whole ``[S, M, .]``
    tensors (None: not needed). Summed in this rank's slot order, the same on every call."""

    def __init__(self, fixed, arriving: str, k: int):
        self.fixed, self.lhs, self.k = list(fixed), arriving == "lhs", k
        self.out: list[torch.Tensor | None] = [None] * len(self.fixed)

    def __call__(self, view, a_rows: torch.Tensor) -> None:
        a_XK = a_rows.flatten(0, -2)
        for i, f in enumerate(self.fixed):
            if f is None:
                continue
            f_XN = view(f).flatten(0, -2)
            x, z = (a_XK.t(), f_XN) if self.lhs else (f_XN.t(), a_XK)
            if self.out[i] is None:
                self.out[i] = modes.gemm(x, z)
            elif modes.current() != "comm_only":  # accumulate in place: no second [K, N]
                self.out[i].addmm_(x, z)

    def result(self, like: torch.Tensor) -> list[torch.Tensor | None]:
        """The sums (zeros where no slot had rows; None where ``fixed`` was None)."""
        def shape(f):
            return (self.k, f.shape[-1]) if self.lhs else (f.shape[-1], self.k)
        return [None if f is None else o if o is not None else like.new_zeros(shape(f))
                for f, o in zip(self.fixed, self.out)]

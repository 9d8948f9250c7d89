"""GEMM <-> all-to-all (Ulysses sequence parallelism around attention).

    matmul_a2a:  Y = all_to_all(A @ B)   scatter the columns (heads), gather the sequence
    a2a_matmul:  Y = all_to_all(A) @ B   scatter the sequence, gather the columns

Legend (suffixes of tensor names): W group size, r this rank, s one rank's sequence slice,
S the full sequence (moved to the front), M the other leading dims, K the contraction,
N the full column count, n = N/W one rank's column block (head group), k = K/W likewise.
Slot p: the sequence slice or column block that belongs to rank p. Sequence slices may be
uneven (rank p's has sizes[p] rows; S = sum(sizes)); column blocks are always N/W.
"""

from __future__ import annotations

import types

import torch

from commfuse.ops.binding import Binding, execute
from commfuse.runtime import modes
from commfuse.schedule import Transfer


class _ScatterColumnsBinding(Binding):
    """matmul_a2a: compute ``a_sMK @ b_KN[:, block p]`` for each p, send it to rank p."""

    def __init__(self, a_sMK, b_KN, sizes, world: int, rank: int, spec):
        self.a, self.b, self.world, self.rank = a_sMK, b_KN, world, rank
        self.cut(sizes, spec)
        self.n = b_KN.shape[1] // world
        self.y_SMn = a_sMK.new_empty((self.total, *a_sMK.shape[1:-1], self.n))
        self.part: dict[int, torch.Tensor] = {}
        self.recv: dict[int, torch.Tensor] = {}

    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send":
            return self.part[t.slot]
        return self.y_SMn[self.rows(t.slot)]  # rank p's rows land in their place

    def compute(self, slot: int) -> None:
        if self.pieces:  # rows of chunk `slot`, all column blocks, laid out block-major
            off, n = self.piece(slot)
            y = modes.gemm(self.a[off:off + n], self.b)
            self.part[slot] = y.unflatten(-1, (self.world, self.n)).movedim(-2, 0).contiguous()
            return
        p = slot // self.m  # my sub-slice slot % m, rank p's column block
        a, b_Kn = self.a[self.sub_rows(slot, self.rank)], self.b[:, p * self.n:(p + 1) * self.n]
        if p == self.rank:
            modes.gemm(a, b_Kn, out=self.y_SMn[self.rows(slot)])
        else:
            self.part[slot] = modes.gemm(a, b_Kn)

    def collective(self, slot: int, transport):
        sizes = self.chunk_sizes(slot)
        out = self.y_SMn if self.whole else self.y_SMn.new_empty((sum(sizes), *self.y_SMn.shape[1:]))
        self.recv[slot] = out
        return transport.launch("all_to_all", out, self.part[slot].flatten(0, 1), slot,
                                sizes=sizes, in_sizes=[self.piece(slot)[1]] * self.world)

    def collective_done(self, slot: int) -> None:
        del self.part[slot]
        out = self.recv.pop(slot)
        if out is not self.y_SMn:
            self.place(self.y_SMn, slot, out)


class _GatherColumnsBinding(Binding):
    """a2a_matmul: receive rank p's column block of my sequence slice, multiply by B's rows p."""

    def __init__(self, a_SMk, b_KN, sizes, world: int, rank: int, spec):
        self.a, self.b, self.world, self.rank = a_SMk, b_KN, world, rank
        self.cut(sizes, spec)
        self.k = a_SMk.shape[-1]
        self.y_sMN = a_SMk.new_empty((self.s, *a_SMk.shape[1:-1], b_KN.shape[1]))
        own = [] if self.pieces else [rank * self.m + j for j in range(self.m)]
        self.blocks: dict[int, torch.Tensor] = {slot: self.a[self.rows(slot)] for slot in own}
        self.started: set[int] = set()  # sub-slices whose first block is in y
        self.x_chunks: dict[int, torch.Tensor] = {}

    def buffer(self, t: Transfer) -> torch.Tensor:
        if t.kind == "send":  # my column block of rank p's sequence rows
            return self.a[self.rows(t.slot)]
        r = self.sub_rows(t.slot, self.rank)  # rank p's column block of my rows
        buf = self.blocks[t.slot] = self.a.new_empty((r.stop - r.start, *self.a.shape[1:]))
        return buf

    def compute(self, slot: int) -> None:
        if self.pieces:  # chunk `slot`: all column blocks side by side, one GEMM
            off, n = self.piece(slot)
            x = self.x_chunks[slot].movedim(0, -2).flatten(-2)
            self.x_chunks[slot] = x
            modes.gemm(x, self.b, out=self.y_sMN[off:off + n])
            return
        p, j = divmod(slot, self.m)
        y = modes.gemm(self.blocks[slot], self.b[p * self.k:(p + 1) * self.k])
        dst = self.y_sMN[self.sub_rows(slot, self.rank)]
        if j in self.started:
            dst.add_(y)  # own block first, then r-1, r-2, ...
        else:
            dst.copy_(y)
            self.started.add(j)

    def collective(self, slot: int, transport):
        sizes = self.chunk_sizes(slot)
        send = self.flat(self.chunk_rows(self.a, slot)).contiguous()
        n = self.piece(slot)[1]
        out = self.x_chunks[slot] = send.new_empty((self.world, n, *send.shape[1:]))
        return transport.launch("all_to_all", out.flatten(0, 1), send, slot,
                                sizes=[n] * self.world, in_sizes=sizes)

    def gathered(self) -> torch.Tensor:
        """The exchanged input ``[s, M, W*k]`` (all column blocks of my slice), for dB."""
        if self.pieces:
            return torch.cat([self.x_chunks[j] for j in range(len(self.pieces[0]))], 0)
        return torch.cat([torch.cat([self.blocks[p * self.m + j] for p in range(self.world)], -1)
                          for j in range(self.m)], 0)


def matmul_a2a(a_sMK, b_KN, sizes, group, spec) -> torch.Tensor:
    """No autograd: ``all_to_all(a_sMK @ b_KN)`` -> ``[S, M, N/W]`` under ``spec``; rank p's
    sequence slice has ``sizes[p]`` rows."""
    binding = _ScatterColumnsBinding(a_sMK, b_KN, sizes, group.size(), group.rank(), spec)
    execute("matmul_a2a", spec, group, binding, a_sMK.device)
    return binding.y_SMn


def a2a_matmul(a_SMk, b_KN, sizes, group, spec) -> tuple[torch.Tensor, _GatherColumnsBinding]:
    """No autograd: ``all_to_all(a_SMk) @ b_KN`` -> ``[sizes[rank], M, N]``, and the binding
    (for dB)."""
    binding = _GatherColumnsBinding(a_SMk.contiguous(), b_KN, sizes, group.size(), group.rank(), spec)
    execute("a2a_matmul", spec, group, binding, a_SMk.device)
    return binding.y_sMN, binding


def _a2a_matmul_x(a_SMk, b_KN, sizes, group, spec, keep_x: bool = True):
    """`a2a_matmul` -> (y, the exchanged input x or None)."""
    y_sMN, binding = a2a_matmul(a_SMk, b_KN, sizes, group, spec)
    return y_sMN, binding.gathered() if keep_x else None


# The kernels the backward formulas run: these Python ones in eager, the custom ops of
# `commfuse.ops.library` (which take the group by name) under torch.compile.
KERNELS = types.SimpleNamespace(matmul_a2a=matmul_a2a, a2a_matmul=_a2a_matmul_x)


def matmul_a2a_backward(a_sMK, b_KN, gy_SMn, sizes, group, spec, need_b: bool,
                        kernels=KERNELS):
    """(dA, dB) of `MatmulAllToAll`, sequence dim first: the a2a -> GEMM of ``dY`` by B^T,
    and ``A^T @ all_to_all(dY)`` from its exchanged input."""
    ga_sMK, x = kernels.a2a_matmul(gy_SMn, b_KN.t(), sizes, group, spec, keep_x=need_b)
    gb = a_sMK.flatten(0, -2).t() @ x.flatten(0, -2) if need_b else None
    return ga_sMK, gb


def a2a_matmul_backward(b_KN, x, gy_sMN, sizes, group, spec, kernels=KERNELS):
    """(dA, dB) of `AllToAllMatmul`, sequence dim first: the GEMM -> a2a of ``dY @ B^T``, and
    ``X^T @ dY`` with X the forward's exchanged input (None: dB not needed)."""
    ga_SMk = kernels.matmul_a2a(gy_sMN, b_KN.t(), sizes, group, spec)
    gb = x.flatten(0, -2).t() @ gy_sMN.flatten(0, -2) if x is not None else None
    return ga_SMk, gb


class MatmulAllToAll(torch.autograd.Function):
    """``Y = all_to_all(A @ B)``: my sequence slice, all heads -> full sequence, my heads.

    Shapes: A [.., s, .., K] (s at ``dim``; rank p's has ``sizes[p]`` rows), B [K, N]
    (replicated), N divisible by W; returns Y [.., S, .., N/W], S = sum(sizes).
    Input grad:  dA = all_to_all(dY) @ B^T, the dual a2a -> GEMM with the same method.
    Weight grad: dB = A^T @ all_to_all(dY) (this rank's contribution; reduce over the group
    as for any replicated weight).  Extra memory: W-1 column blocks in flight (N/W each).
    """

    @staticmethod
    def forward(ctx, a, b, dim, sizes, group, spec):
        y_SMn = matmul_a2a(a.movedim(dim, 0), b, sizes, group, spec)
        ctx.save_for_backward(a, b)
        ctx.dim, ctx.sizes, ctx.group, ctx.spec = dim, sizes, group, spec
        return y_SMn.movedim(0, dim)

    @staticmethod
    def backward(ctx, gy):
        a, b = ctx.saved_tensors
        ga_sMK, gb = matmul_a2a_backward(a.movedim(ctx.dim, 0), b, gy.movedim(ctx.dim, 0),
                                         ctx.sizes, ctx.group, ctx.spec, ctx.needs_input_grad[1])
        return ga_sMK.movedim(0, ctx.dim), gb, None, None, None, None


class AllToAllMatmul(torch.autograd.Function):
    """``Y = all_to_all(A) @ B``: full sequence, my heads -> my sequence slice, all heads.

    Shapes: A [.., S, .., k] (S at ``dim``), B [W*k, N] (replicated); returns Y [.., s, .., N]
    = concat_over_ranks(A[my slice], -1) @ B, my slice being ``sizes[rank]`` rows of S.
    Input grad:  dA = all_to_all(dY @ B^T), the dual GEMM -> a2a with the same method.
    Weight grad: dB = X^T @ dY with X the exchanged input (saved from the forward).
    Extra memory: the W-1 received blocks (k columns each), kept as X for the weight grad.
    """

    @staticmethod
    def forward(ctx, a, b, dim, sizes, group, spec):
        y_sMN, binding = a2a_matmul(a.movedim(dim, 0), b, sizes, group, spec)
        x = binding.gathered() if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(b, x)
        ctx.dim, ctx.sizes, ctx.group, ctx.spec = dim, sizes, group, spec
        return y_sMN.movedim(0, dim)

    @staticmethod
    def backward(ctx, gy):
        b, x = ctx.saved_tensors
        ga_SMk, gb = a2a_matmul_backward(b, x, gy.movedim(ctx.dim, 0), ctx.sizes, ctx.group,
                                         ctx.spec)
        return ga_SMk.movedim(0, ctx.dim), gb, None, None, None, None

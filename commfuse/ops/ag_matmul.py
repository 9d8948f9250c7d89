"""All-gather -> GEMM (TPSP column-parallel linear forward, ZeRO-3 parameter gather).

    A = all_gather(A_shard, gather_dim);  Y_i = A @ B_i

Legend (suffixes of tensor names): W group size, r this rank, s one rank's slice of the
gathered dim, S = W*s the gathered dim (moved to the front), M the other leading dims,
K the contraction, N a GEMM's output columns. Slot p is rank p's slice, rows [p*s, (p+1)*s).
"""

from __future__ import annotations

import torch

from commfuse import executor
from commfuse.ops import _common
from commfuse.schedule import Transfer


class _GatherBinding(_common.Binding):
    """The buffers of one call: the gathered ``a_SMK`` (returned too) and the outputs."""

    def __init__(self, a_sMK: torch.Tensor, bs_KN, world: int, rank: int, spec):
        self.a_sMK, self.bs_KN, self.world, self.rank = a_sMK, bs_KN, world, rank
        self.cut(s := a_sMK.shape[0], spec)
        self.a_SMK = a_sMK.new_empty((world * s, *a_sMK.shape[1:]))
        self.ys_SMN = [a_sMK.new_empty((world * s, *a_sMK.shape[1:-1], b.shape[1]))
                       for b in bs_KN]
        self.gathered: dict[int, torch.Tensor] = {}
        if not self.pieces:
            self.a_SMK[rank * s:(rank + 1) * s].copy_(a_sMK)

    # P2P methods: a sub-slice of the gathered buffer travels, and is computed on in place
    def buffer(self, t: Transfer) -> torch.Tensor:
        return self.a_SMK[self.rows(t.slot)]

    def compute(self, slot: int) -> None:
        if self.pieces:
            return self._compute_chunk(slot)
        rows = self.rows(slot)
        for b_KN, y_SMN in zip(self.bs_KN, self.ys_SMN):
            executor.gemm(self.a_SMK[rows], b_KN, out=y_SMN[rows])

    # sliced / none: all_gather chunk j (rows [off, off+n) of every slice), then its GEMMs
    def collective(self, slot: int, transport):
        off, n = self.pieces[slot]
        whole = n == self.s  # one chunk: gather straight into the result
        out = self.a_SMK if whole else self.a_sMK.new_empty((self.world * n, *self.a_sMK.shape[1:]))
        self.gathered[slot] = out
        return transport.launch("all_gather", out, self.a_sMK[off:off + n], slot)

    def collective_done(self, slot: int) -> None:
        off, n = self.pieces[slot]
        if n != self.s:
            self.a_SMK.unflatten(0, (self.world, self.s))[:, off:off + n].copy_(
                self.gathered[slot].unflatten(0, (self.world, n)))

    def _compute_chunk(self, slot: int) -> None:
        off, n = self.pieces[slot]
        a = self.gathered.pop(slot)
        for b_KN, y_SMN in zip(self.bs_KN, self.ys_SMN):
            if n == self.s:
                executor.gemm(a, b_KN, out=y_SMN)
            else:
                y_SMN.unflatten(0, (self.world, self.s))[:, off:off + n].copy_(
                    executor.gemm(a, b_KN).unflatten(0, (self.world, n)))



def ag_matmul(a_sMK: torch.Tensor, bs_KN, group, spec) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """No autograd: ``(all_gather(a_sMK, 0), [A @ b for b in bs_KN])`` under ``spec``."""
    binding = _GatherBinding(a_sMK.contiguous(), bs_KN, group.size(), group.rank(), spec)
    _common.execute("ag_matmul", spec, group, binding, a_sMK.device)
    return binding.a_SMK, binding.ys_SMN


class AllGatherMatmul(torch.autograd.Function):
    """``A = all_gather(A_shard, dim)``, ``Y_i = A @ B_i``.

    Shapes: A_shard [.., s, .., K] (s at ``dim``), B_i [K, N_i] (this rank's column shard);
    returns A [.., W*s, .., K] and Y_i [.., W*s, .., N_i].
    Input grad:  dA_shard = reduce_scatter(dA + sum_i dY_i @ B_i^T, dim), run as the dual
    GEMM -> reduce-scatter with the same method.  Weight grad: dB_i = A^T @ dY_i (local).
    Extra memory: none beyond the outputs (receives land in A); A is saved for backward.
    """

    @staticmethod
    def forward(ctx, a_shard, dim, group, spec, *bs):
        a_SMK, ys = ag_matmul(a_shard.movedim(dim, 0), bs, group, spec)
        ctx.save_for_backward(a_SMK, *bs)
        ctx.dim, ctx.group, ctx.spec = dim, group, spec
        return (a_SMK.movedim(0, dim), *(y.movedim(0, dim) for y in ys))

    @staticmethod
    def backward(ctx, ga, *gys):
        from commfuse.ops.matmul_rs import matmul_rs

        a_SMK, *bs = ctx.saved_tensors
        gys_SMN = [g.movedim(ctx.dim, 0) for g in gys]
        ga_shard = None
        if ctx.needs_input_grad[0]:
            terms = [(g, b.t()) for g, b in zip(gys_SMN, bs)]
            ga_shard = matmul_rs(terms, ga.movedim(ctx.dim, 0), ctx.group, ctx.spec)
            ga_shard = ga_shard.movedim(0, ctx.dim)
        a_XK = a_SMK.flatten(0, -2)
        gbs = [a_XK.t() @ g.flatten(0, -2) if need else None
               for g, need in zip(gys_SMN, ctx.needs_input_grad[4:])]
        return (ga_shard, None, None, None, *gbs)

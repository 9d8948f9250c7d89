"""The autograd Functions of all-gather -> GEMM and GEMM -> reduce-scatter (TPSP's column- and
row-parallel linears). Each is the other's backward, so the pair lives together, as the
all-to-all pair does in `commfuse.ops.all_to_all`; the schedules they run are in
`commfuse.ops.ag_matmul` and `commfuse.ops.matmul_rs`.

Legend (suffixes of tensor names): s one rank's slice of the gathered/scattered dim, S the
whole dim (moved to the front), M the other leading dims, K the contraction, N output columns.
"""

from __future__ import annotations

import types

import torch

from commfuse.ops.ag_matmul import ag_matmul
from commfuse.ops.matmul_rs import matmul_rs

# The kernels the backward formulas run: these Python ones in eager, the custom ops of
# `commfuse.ops.library` (which take the group by name) under torch.compile.
KERNELS = types.SimpleNamespace(ag_matmul=ag_matmul, matmul_rs=matmul_rs,
                                world=lambda group: group.size())


def ag_matmul_backward(a_SMK, bs_KN, ga_SMK, gys_SMN, sizes, group, spec, need_a: bool,
                       need_bs, kernels=KERNELS):
    """(dA_shard, [dB_i]) of `AllGatherMatmul`, dim first: the GEMM -> reduce-scatter of
    ``ga + sum_i gy_i @ B_i^T`` and the local ``A^T @ gy_i`` (None where not needed)."""
    ga_sMK = None
    if need_a:
        terms = [(g, b.t()) for g, b in zip(gys_SMN, bs_KN)]
        ga_sMK = kernels.matmul_rs(terms, ga_SMK, sizes, group, spec)
    a_XK = a_SMK.flatten(0, -2)
    return ga_sMK, [a_XK.t() @ g.flatten(0, -2) if need else None
                    for g, need in zip(gys_SMN, need_bs)]


def matmul_rs_backward(a_SMK, b_KN, gc_sMN, avg: bool, sizes, group, spec, need_b: bool,
                       kernels=KERNELS):
    """(dA, dB) of `MatmulReduceScatter`, dim first: the all-gather -> GEMM of ``dC @ B^T``
    (dC / W for avg), and ``A^T @ all_gather(dC)`` from the gathered dC."""
    if avg:
        gc_sMN = gc_sMN / kernels.world(group)
    gc_SMN, (ga_SMK,) = kernels.ag_matmul(gc_sMN, [b_KN.t()], sizes, group, spec)
    gb = a_SMK.flatten(0, -2).t() @ gc_SMN.flatten(0, -2) if need_b else None
    return ga_SMK, gb


class AllGatherMatmul(torch.autograd.Function):
    """``A = all_gather(A_shard, dim)``, ``Y_i = A @ B_i``.

    Shapes: A_shard [.., s, .., K] (s at ``dim``; rank p's has ``sizes[p]`` rows), B_i [K, N_i]
    (this rank's column shard); returns A [.., S, .., K] and Y_i [.., S, .., N_i], S = sum(sizes).
    Input grad:  dA_shard = reduce_scatter(dA + sum_i dY_i @ B_i^T, dim), run as the dual
    GEMM -> reduce-scatter with the same method.  Weight grad: dB_i = A^T @ dY_i (local).
    Extra memory: none beyond the outputs (receives land in A); A is saved for backward.
    """

    @staticmethod
    def forward(ctx, a_shard, dim, sizes, group, spec, *bs):
        a_SMK, ys = ag_matmul(a_shard.movedim(dim, 0), bs, sizes, group, spec)
        ctx.save_for_backward(a_SMK, *bs)
        ctx.dim, ctx.sizes, ctx.group, ctx.spec = dim, sizes, group, spec
        return (a_SMK.movedim(0, dim), *(y.movedim(0, dim) for y in ys))

    @staticmethod
    def backward(ctx, ga, *gys):
        a_SMK, *bs = ctx.saved_tensors
        ga_sMK, gbs = ag_matmul_backward(a_SMK, bs, ga.movedim(ctx.dim, 0),
                                         [g.movedim(ctx.dim, 0) for g in gys], ctx.sizes,
                                         ctx.group, ctx.spec, ctx.needs_input_grad[0],
                                         ctx.needs_input_grad[5:])
        ga_shard = ga_sMK.movedim(0, ctx.dim) if ga_sMK is not None else None
        return (ga_shard, None, None, None, None, *gbs)


class MatmulReduceScatter(torch.autograd.Function):
    """``C = reduce_scatter(A @ B, dim)``, summed (or averaged) over the group.

    Shapes: A [.., S, .., K] (S at ``dim``), B [K, N] (this rank's row shard);
    returns C [.., s, .., N], this rank's slice (``sizes[rank]`` rows of S = sum(sizes)).
    Input grad:  dA = all_gather(dC, dim) @ B^T, run as the dual all-gather -> GEMM with the
    same method (dC / W for avg).  Weight grad: dB = A^T @ all_gather(dC, dim).
    Extra memory: ring: one partial and one receive buffer of C's size per step in flight;
    direct: W-1 receive buffers of C's size; sliced/none: the partial GEMM output (W x C).
    """

    @staticmethod
    def forward(ctx, a, b, dim, avg, sizes, group, spec):
        c_sMN = matmul_rs([(a.movedim(dim, 0), b)], None, sizes, group, spec)
        if avg:
            c_sMN = c_sMN.div_(group.size())
        ctx.save_for_backward(a, b)
        ctx.dim, ctx.avg, ctx.sizes, ctx.group, ctx.spec = dim, avg, sizes, group, spec
        return c_sMN.movedim(0, dim)

    @staticmethod
    def backward(ctx, gc):
        a, b = ctx.saved_tensors
        ga_SMK, gb = matmul_rs_backward(a.movedim(ctx.dim, 0), b, gc.movedim(ctx.dim, 0),
                                        ctx.avg, ctx.sizes, ctx.group, ctx.spec,
                                        ctx.needs_input_grad[1])
        return ga_SMK.movedim(0, ctx.dim), gb, None, None, None, None, None

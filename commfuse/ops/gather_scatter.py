"""The autograd Functions of all-gather -> GEMM and GEMM -> reduce-scatter (TPSP's column- and
row-parallel linears). Each is the other's backward, so the pair lives together, as the
all-to-all pair does in `commfuse.ops.all_to_all`; the schedules they run are in
`commfuse.ops.ag_matmul` and `commfuse.ops.matmul_rs`. The backward passes are plain functions
(`ag_matmul_backward`, `matmul_rs_backward`) on tensors, reusable outside these Functions.

Legend (suffixes of tensor names): s one rank's slice of the gathered/scattered dim, S the
whole dim (moved to the front), M the other leading dims, K the contraction, N output columns.
"""

from __future__ import annotations

import types

import torch

from commfuse.ops.ag_matmul import SlotGEMMs, ag_matmul
from commfuse.ops.matmul_rs import matmul_rs
from commfuse.ops.prefetch import posting


class AllGatherMatmul(torch.autograd.Function):
    """``A = all_gather(A_shard, dim)``, ``Y_i = A @ B_i``.

    Shapes: A_shard [.., s, .., K] (s at ``dim``; rank p's has ``sizes[p]`` rows), B_i [K, N_i]
    (this rank's column shard); returns A [.., S, .., K] and Y_i [.., S, .., N_i], S = sum(sizes).
    Input grad:  dA_shard = reduce_scatter(dA + sum_i dY_i @ B_i^T, dim), run as the dual
    GEMM -> reduce-scatter with the same method.  Weight grad: dB_i = A^T @ dY_i.
    Saved for backward: A_shard and the B_i (``save_gathered=False``, the default); the
    backward gathers A again with the same method and computes dB_i += A[slot]^T @ dY_i[slot]
    on each slot as it arrives (the weight-grad GEMMs hide that gather), then the
    reduce-scatter (its transfers hide behind the input-grad GEMMs). ``save_gathered=True``
    saves the gathered A instead (no second gather; dB_i is one GEMM). With a ``prefetcher``
    (`commfuse.ops.prefetch`) the next fused op's backward may post that gather ahead; the
    backward then only waits for it, slot by slot (same GEMMs, same order).
    Extra memory: forward, none beyond the outputs (receives land in A); between forward and
    backward, nothing beyond A_shard (A with ``save_gathered``); backward, one gathered A
    while the dB_i are computed, then the reduce-scatter's (GEMM -> RS).
    """

    @staticmethod
    def forward(ctx, a_shard, dim, sizes, group, spec, save_gathered, prefetcher, *bs):
        a_SMK, ys = ag_matmul(a_shard.movedim(dim, 0), bs, sizes, group, spec)
        a_out = a_SMK.movedim(0, dim)
        ctx.save_for_backward(a_out if save_gathered else a_shard, *bs)
        ctx.dim, ctx.sizes, ctx.group, ctx.spec = dim, sizes, group, spec
        ctx.gathered = save_gathered
        ctx.ticket = None  # the backward's gather, if a prefetcher may post it ahead
        if prefetcher is not None and not save_gathered and any(ctx.needs_input_grad[7:]):
            ctx.ticket = prefetcher.record(a_shard.movedim(dim, 0), sizes, group, spec)
        ctx.set_materialize_grads(False)  # unused outputs (A, with return_A=False): no zeros
        return (a_out, *(y.movedim(0, dim) for y in ys))

    @staticmethod
    def backward(ctx, ga, *gys):
        a, *bs = ctx.saved_tensors
        posted = None
        if ctx.ticket is not None:  # posted ahead by the next op's backward, or not
            ticket, ctx.ticket = ctx.ticket, None
            posted = ticket.take()
        ga_shard, gbs = ag_matmul_backward(
            a, bs, ga, gys, ctx.dim, ctx.sizes, ctx.group, ctx.spec, gathered=ctx.gathered,
            need_a=ctx.needs_input_grad[0], need_bs=ctx.needs_input_grad[7:], prefetched=posted)
        return (ga_shard, None, None, None, None, None, None, *gbs)


def ag_matmul_backward(a, bs, ga, gys, dim, sizes, group, spec, *, gathered: bool = False,
                       need_a: bool = True, need_bs=None, prefetched=None):
    """Gradients of ``(A, [A @ B_i]) = ag_matmul(A_shard, Bs)``: ``(dA_shard, [dB_i])``.

    ``a``: A_shard, or the gathered A if ``gathered``; ``ga`` / ``gys``: the output grads
    (None: zero). Without ``gathered``, A is gathered again as a fused schedule under
    ``spec`` whose per-slot compute is dB_i += A[slot]^T @ dY_i[slot]; then dA_shard =
    reduce_scatter(dA + sum_i dY_i @ B_i^T) runs as the dual fused op. ``need_bs[i]`` False
    (or ``need_a`` False) skips that gradient (None is returned for it). ``prefetched``: that
    gather already posted (`commfuse.ops.ag_matmul.PostedGather`, `commfuse.ops.prefetch`):
    its rest runs here with the same per-slot GEMMs, in the same slot order.
    """
    # which collectives run depends only on need_a / need_bs (requires_grad, the same on every
    # rank), never on which output grads are None here, so the ranks' schedules match
    need_bs = [True] * len(bs) if need_bs is None else list(need_bs)
    gys_SMN = [None if g is None else g.movedim(dim, 0) for g in gys]
    wanted = [g if need else None for g, need in zip(gys_SMN, need_bs)]
    gbs: list[torch.Tensor | None] = [None] * len(bs)
    if gathered:  # A is here whole: one GEMM per weight
        a_XK = a.movedim(dim, 0).flatten(0, -2)
        gbs = [None if g is None else a_XK.t() @ g.flatten(0, -2) for g in wanted]
    elif any(need_bs):  # gather A again; each arriving slot feeds the weight-grad GEMMs
        grads = SlotGEMMs(wanted, "lhs", a.shape[-1])
        if prefetched is not None:  # its transfers moved during the work since it was posted
            prefetched.finish(grads)
        else:
            ag_matmul(a.movedim(dim, 0), [], sizes, group, spec, consume=grads)
        gbs = grads.result(a)
    elif prefetched is not None:  # posted, but no weight needs a gradient after all
        prefetched.abandon()
    for i, (need, gy) in enumerate(zip(need_bs, gys)):
        if need and gy is None:  # no grad reached Y_i: dB_i is zero
            gbs[i] = bs[i].new_zeros(bs[i].shape)
    if not need_a:
        return None, gbs
    ga_SMK = None if ga is None else ga.movedim(dim, 0)
    terms = [(g, b.t()) for g, b in zip(gys_SMN, bs) if g is not None]
    if not terms:  # no grad reached any Y_i: a zero GEMM (one column) carries dA (or zeros)
        shape_SM = (sum(sizes), *a.movedim(dim, 0).shape[1:-1])
        terms = [(a.new_zeros((*shape_SM, 1)), a.new_zeros((1, a.shape[-1])))]
    ga_shard = matmul_rs(terms, ga_SMK, sizes, group, spec)
    return ga_shard.movedim(0, dim), gbs


class MatmulReduceScatter(torch.autograd.Function):
    """``C = reduce_scatter(A @ B, dim)``, summed (or averaged) over the group.

    Shapes: A [.., S, .., K] (S at ``dim``), B [K, N] (this rank's row shard);
    returns C [.., s, .., N], this rank's slice (``sizes[rank]`` rows of S = sum(sizes)).
    Input grad:  dA = all_gather(dC, dim) @ B^T, run as the dual all-gather -> GEMM with the
    same method (dC / W for avg).  Weight grad: dB = A^T @ all_gather(dC, dim), computed
    inside that schedule, dB += A[slot]^T @ dC[slot] on each slot of dC as it arrives.
    Extra memory: ring: one partial and one receive buffer of C's size per step in flight;
    direct: W-1 receive buffers of C's size; sliced/none: the partial GEMM output (W x C).
    Saved for backward: A and B (inputs). Backward: the gathered dC (W x C), freed at its end.
    """

    @staticmethod
    def forward(ctx, a, b, dim, avg, sizes, group, spec, prefetcher=None):
        c_sMN = matmul_rs([(a.movedim(dim, 0), b)], None, sizes, group, spec)
        if avg:
            c_sMN = c_sMN.div_(group.size())
        ctx.save_for_backward(a, b)
        ctx.dim, ctx.avg, ctx.sizes, ctx.group, ctx.spec = dim, avg, sizes, group, spec
        # the AG->GEMM just before this op: its re-gather is posted by this op's backward
        ctx.ticket = None if prefetcher is None else prefetcher.claim()
        return c_sMN.movedim(0, dim)

    @staticmethod
    def backward(ctx, gc):
        a, b = ctx.saved_tensors
        ticket, ctx.ticket = ctx.ticket, None
        ga, gb = posting(ticket, lambda after_posts: matmul_rs_backward(
            a, b, gc, ctx.dim, ctx.avg, ctx.sizes, ctx.group, ctx.spec,
            need_a=ctx.needs_input_grad[0], need_b=ctx.needs_input_grad[1],
            after_posts=after_posts))
        return ga, gb, None, None, None, None, None, None


def matmul_rs_backward(a, b, gc, dim, avg, sizes, group, spec, *, need_a: bool = True,
                       need_b: bool = True, after_posts=None):
    """Gradients ``(dA, dB)`` of ``C = matmul_rs(A, B)``: one fused all-gather of dC under
    ``spec`` whose per-slot compute is dA[slot] = dC[slot] @ B^T and dB += A[slot]^T @ dC[slot]
    (so both GEMMs hide its transfers). None for a gradient not needed. ``after_posts()``
    runs right after that gather's last post (where the previous AG->GEMM's re-gather is
    posted ahead, `commfuse.ops.prefetch`)."""
    gc_sMN = gc.movedim(dim, 0)
    if avg:
        gc_sMN = gc_sMN / group.size()
    grads = SlotGEMMs([a.movedim(dim, 0) if need_b else None], "rhs", b.shape[1])
    _, ys = ag_matmul(gc_sMN, [b.t()] if need_a else [], sizes, group, spec,
                      consume=grads if need_b else None, after_posts=after_posts)
    ga = ys[0].movedim(0, dim) if need_a else None
    return ga, grads.result(a)[0]


# Under torch.compile (`commfuse.ops.library`) the backward runs on the custom ops, which take
# the group by name: the AG->GEMM saves the gathered A there (no re-gather with per-slot
# weight-grad GEMMs yet), and its backward and GEMM->RS's are these formulas on KERNELS.
KERNELS = types.SimpleNamespace(ag_matmul=ag_matmul, matmul_rs=matmul_rs,
                                world=lambda group: group.size())


def saved_ag_matmul_backward(a_SMK, bs_KN, ga_SMK, gys_SMN, sizes, group, spec, need_a: bool,
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


def gathered_matmul_rs_backward(a_SMK, b_KN, gc_sMN, avg: bool, sizes, group, spec,
                                need_b: bool, kernels=KERNELS):
    """(dA, dB) of `MatmulReduceScatter`, dim first: the all-gather -> GEMM of ``dC @ B^T``
    (dC / W for avg), and ``A^T @ all_gather(dC)`` from the gathered dC."""
    if avg:
        gc_sMN = gc_sMN / kernels.world(group)
    gc_SMN, (ga_SMK,) = kernels.ag_matmul(gc_sMN, [b_KN.t()], sizes, group, spec)
    gb = a_SMK.flatten(0, -2).t() @ gc_SMN.flatten(0, -2) if need_b else None
    return ga_SMK, gb

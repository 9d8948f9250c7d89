"""Expert parallelism's fused ops: the dispatch all-to-all feeding the experts' first GEMM,
the experts' last GEMM feeding the combine all-to-all, with variable per-peer counts.

    moe_dispatch_matmul:  Y = dispatch(X) @ W[e]    per (source slot, local expert) group
    moe_matmul_combine:   Y = combine(A @ W[e])     each source's rows sent back when computed

Legend (suffixes): T rows of this rank's send layout (its tokens, one row per chosen expert,
sorted by global expert), R rows of its receive layout (what its experts get, source-major,
sorted by local expert inside each source slot), E its local experts (E_l), K the
contraction, N the output columns. The layouts and the schedules are
`commfuse.schedule.moe`'s, the bindings that run them `commfuse.ops.moe.bindings`'; the
counts, the same table on every rank, come from `commfuse.ops.moe.counts.exchange_counts`
once per step.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from commfuse.ops import checks
from commfuse.ops.methods import MethodSpec, method_spec
from commfuse.ops.moe.bindings import dispatch_matmul, matmul_combine
from commfuse.ops.moe.counts import agree_counts
from commfuse.ops.moe.gemm import weight_grads
from commfuse.schedule.moe import ExpertCounts


class DispatchMatmul(torch.autograd.Function):
    """``Y = dispatch(X) @ W``: my moved rows -> my experts' rows, projected.

    Shapes: X [T, K] (send layout, T = counts.dispatched(rank)), W [E_l, K, N] (this rank's
    experts); returns Y [R, N] (expanded receive layout, R = counts.received(rank)), group
    (p, e) = the rows rank p routed to my expert e, times W[e]. With ``routing`` (dedup) X
    holds one row per (token, destination rank), expanded here to one per (token, expert).
    Input grad:  dX = combine(dY @ W[e]^T), the dual GEMM -> combine with the same method
    (with dedup each pair's rows summed before they move, back in X's order).
    Weight grad: dW[e] = X_e^T @ dY_e over every row expert e received (complete on this
    rank: an expert lives on one rank of the EP group).
    Extra memory: the expanded rows X [R, K], kept for the weight grad.
    """

    @staticmethod
    def forward(ctx, x, w, counts, group, spec, routing):
        y_RN, x_RK, _, _ = dispatch_matmul(x, w, counts, group, spec, routing=routing)
        ctx.save_for_backward(w, x_RK)
        ctx.counts, ctx.group, ctx.spec, ctx.routing = counts, group, spec, routing
        return y_RN

    @staticmethod
    def backward(ctx, gy_RN):
        w, x_RK = ctx.saved_tensors
        gy_RN = gy_RN.contiguous()
        runs = ctx.counts.expert_runs(ctx.group.rank())
        wgrad = (lambda _: weight_grads(x_RK, gy_RN, runs, w.shape[0])) \
            if ctx.needs_input_grad[1] else None
        # the combine runs on every rank whatever this one needs: its peers wait for it; the
        # weight grads hide its last transfers (the schedule's tail)
        gx_TK, gw, _ = matmul_combine(gy_RN, w.transpose(1, 2), ctx.counts, ctx.group, ctx.spec,
                                      wgrad, routing=ctx.routing)
        if ctx.routing is not None:  # combine order -> dispatch order
            gx_TK = gx_TK[ctx.routing.last_of_first]
        return gx_TK if ctx.needs_input_grad[0] else None, gw, None, None, None, None


class MatmulCombine(torch.autograd.Function):
    """``Y = combine(A @ W)``: my experts' rows, projected -> back to their tokens' ranks.

    Shapes: A [R, K] (expanded receive layout), W [E_l, K, N]; returns Y [T, N] (send
    layout): without ``routing`` the rows rank q's experts computed for my tokens, in the
    order I dispatched them; with it (dedup) one row per (token, rank q), the sum over the
    token's experts on q of ``(A_r @ W[e]) * weights[r]`` (each product cast to A's dtype,
    in top-k order), in combine order (`commfuse.ops.moe.routing`). ``weights`` [R] or None
    (a plain sum).
    Input grad:  dA = (dispatch(dY) * weights) @ W[e]^T, the dual dispatch -> GEMM with the
    same method; dweights[r] = dispatch(dY)_r . (A_r @ W[e]).
    Weight grad: dW[e] = A_e^T @ (dispatch(dY) * weights)_e, from that dispatch's rows.
    Extra memory: A is kept for the weight grad, with dedup and weights the unweighted rows
    [R, N] too; in flight, the rows for up to W-1 peers (commfuse) or one chunk (sliced).
    """

    @staticmethod
    def forward(ctx, a, w, weights, counts, group, spec, routing):
        y, _, raw = matmul_combine(a, w, counts, group, spec, routing=routing, weights=weights)
        ctx.save_for_backward(a, w, weights, raw if weights is not None else None)
        ctx.counts, ctx.group, ctx.spec, ctx.routing = counts, group, spec, routing
        return y

    @staticmethod
    def backward(ctx, gy_TN):
        a_RK, w, weights, raw = ctx.saved_tensors
        runs = ctx.counts.expert_runs(ctx.group.rank())
        wgrad = (lambda b: weight_grads(a_RK, b.x_RK, runs, w.shape[0])) \
            if ctx.needs_input_grad[1] else None
        gy_TN = gy_TN.contiguous()
        if ctx.routing is not None:  # combine order -> dispatch order
            gy_TN = gy_TN[ctx.routing.last_of_first]
        # the weight grads need every received row: they run after the last GEMM, beside
        # the sends still in flight
        ga_RK, _, gw, gweights = dispatch_matmul(
            gy_TN, w.transpose(1, 2), ctx.counts, ctx.group, ctx.spec, wgrad,
            routing=ctx.routing, scale=None if weights is None else (weights, raw))
        return (ga_RK if ctx.needs_input_grad[0] else None, gw, gweights, None, None, None,
                None)


def moe_dispatch_matmul(x: torch.Tensor, w: torch.Tensor, counts: ExpertCounts, group=None, *,
                        method: str = "commfuse", check: bool | None = None, routing=None,
                        **opts) -> torch.Tensor:
    """Expert parallelism's first GEMM: ``dispatch(x) @ w[e]`` -> ``[R, N]``.

    ``x`` [T, K]: this rank's rows sorted by global expert (``counts.dispatched(rank)`` of
    them); ``w`` [E_l, K, N]: this rank's experts' weights (e.g. gate|up side by side);
    ``counts``: the table every rank holds (`commfuse.ops.moe.counts.exchange_counts`, or
    `commfuse.ops.moe.routing.plan` with dedup, then ``routing`` from
    `commfuse.ops.moe.routing.to_experts`, and ``x`` one row per (token, rank)). Returns
    the rows my experts got, one per (token, expert), source-major, each source's sorted by
    local expert, times their weights.
    ``method``: "none" | "sliced" (``chunks``) | "commfuse" (``splits``: pieces per slot,
    default 1) | "auto" (the fastest of those on the simulator's cost model for these counts,
    `commfuse.sim.moe.fastest`, agreed between the ranks); ``timeout`` in seconds.
    ``check``: exchange and compare every rank's ``counts`` and rows first (`CountsError`
    on every rank); default ``COMMFUSE_CHECK``.
    """
    spec, group = _prepare("moe_dispatch", x, w, counts, group, method, opts, check, routing)
    return DispatchMatmul.apply(x, w, counts, group, spec, routing)


def moe_matmul_combine(a: torch.Tensor, w: torch.Tensor, counts: ExpertCounts, group=None, *,
                       method: str = "commfuse", check: bool | None = None, routing=None,
                       weights: torch.Tensor | None = None, **opts) -> torch.Tensor:
    """Expert parallelism's last GEMM: ``combine(a @ w[e])`` -> ``[T, N]``.

    ``a`` [R, K]: this rank's experts' rows in the receive layout (as `moe_dispatch_matmul`
    returns them, ``counts.received(rank)`` of them); ``w`` [E_l, K, N]. Returns, for each of
    this rank's dispatched rows, in dispatch order, what its expert computed; with
    ``routing`` (dedup) one row per (token, rank): its experts' rows there summed, times
    ``weights`` [R] (`commfuse.ops.moe.routing.to_experts`) if given, in combine order.
    Options as for `moe_dispatch_matmul`.
    """
    if weights is not None and (routing is None or weights.shape != (a.shape[0],)):
        raise ValueError(f"moe_combine: weights need routing and one weight per row "
                         f"({a.shape[0]}), got {None if weights is None else tuple(weights.shape)}")
    spec, group = _prepare("moe_combine", a, w, counts, group, method, opts, check, routing)
    return MatmulCombine.apply(a, w, weights, counts, group, spec, routing)


def _prepare(op, a, w, counts, group, method, opts, check, routing=None):
    """Validated (spec, group); raises before any communication (`CountsError` on every
    rank in checked mode)."""
    checks.check_tensor("x" if op == "moe_dispatch" else "a", a, 2)
    checks.check_tensor("w", w, 3)
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: want rows [rows, K] and weights [local experts, K, N], got "
                         f"{tuple(a.shape)} and {tuple(w.shape)}")
    if w.dtype != a.dtype or w.device != a.device:
        raise TypeError(f"{op}: w is {w.dtype} on {w.device}, the rows {a.dtype} on {a.device}")
    if not isinstance(counts, ExpertCounts):
        raise TypeError(f"counts must be a commfuse.schedule.moe.ExpertCounts, "
                        f"got {type(counts).__name__}")
    spec = _spec(method, opts)
    group = checks.resolve_group(group)
    if counts.world != group.size() or counts.local != w.shape[0]:
        raise ValueError(f"{op}: counts are for {counts.world} ranks of {counts.local} experts, "
                         f"but the group has {group.size()} ranks and w {w.shape[0]} experts")
    if (routing is not None) != counts.dedup:
        raise ValueError(f"{op}: deduplicated counts need their routing and plain counts "
                         f"none (commfuse.ops.moe.routing)")
    rank = group.rank()
    rows = counts.dispatched(rank) if op == "moe_dispatch" else counts.received(rank)
    if checks.checked(check):
        agree_counts(op, counts, a.shape[0], group, spec.timeout, a.device)
    elif a.shape[0] != rows:
        raise ValueError(f"{op} (rank {rank}): the rows have {a.shape[0]} rows but the counts "
                         f"give this rank {rows}")
    if spec.method == "auto":
        spec = _auto(op, counts, tuple(w.shape[1:]), a, spec, group)
    return spec, group


def _auto(op: str, counts: ExpertCounts, kn: tuple[int, int], like: torch.Tensor,
          spec: MethodSpec, group) -> MethodSpec:
    """auto: the method (none, sliced, commfuse and its pieces m) the simulator times fastest
    for this op and its backward (`commfuse.sim.moe.choose`: per group size, experts and
    rounded total rows, cached), on the hardware model auto uses for the device
    (`commfuse.ops.auto.set_hardware`). Every rank holds the same table, so ranks with the
    same hardware model choose alike; `commfuse.ops.auto.agree` checks that on the first
    call per (op, representative table, K, N, dtype, device) and raises `CommFuseError` on
    every rank if they would not (a rank on another schedule would post other messages)."""
    from commfuse.ops.auto import _hardware, agree
    from commfuse.sim.choose import STEP_OVERHEAD_S
    from commfuse.sim.moe import choose, representative

    dev = like.device.type
    method, opts = choose(op, counts, *kn, _hardware(dev), like.element_size(),
                          STEP_OVERHEAD_S.get(dev, 50e-6))
    rep = representative(counts)  # what the choice depends on: the same on every rank
    moved = rep.firsts[0][0] if rep.dedup else -1
    agree(group, op, (rep.world, rep.experts, rep.tokens[0][0], moved, *kn), like,
          (method, opts), spec.timeout)
    return replace(method_spec(method, opts), timeout=spec.timeout)


def _spec(method, opts) -> MethodSpec:
    """The MoE ops' methods: none, sliced (``chunks``), commfuse (pairwise, each slot in
    ``splits`` pieces, default 1), auto (`_auto`, once the counts are known)."""
    if method == "decompose":
        raise ValueError("the MoE ops offer method 'none', 'sliced', 'commfuse' or 'auto', "
                         "not 'decompose'")
    return method_spec(method, opts)

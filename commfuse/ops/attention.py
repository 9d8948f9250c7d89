"""Query-split attention: TP attention whose out-projection reduce-scatter runs over query slices.

    out = reduce_scatter(attention(Q, K, V) @ W_o, seq)

Row-parallel Flash-RS fuses only the out-projection GEMM with the reduce-scatter. Query-split
runs the whole attention (QK^T, softmax, SV) *and* the out-projection partial per query slice
inside the Flash-RS schedule, so each step's transfer hides behind far more compute; this
rank's own query slice last. Exact: every query row sees the same keys, in the same order.

Legend: S sequence (first), B batch, H this rank's heads, d head dim, D model dim,
s = S/W one rank's slice, X = H*d.

Differentiable: the backward gathers dOut fused with its GEMM by W_o^T (the dual all-gather ->
GEMM, same method), recomputes the attention of the whole sequence for this rank's heads
(like activation checkpointing: Q, K, V are saved, not the attention output) and backpropagates
through it. The forward is where the overlap is; the backward overlaps the gather only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from commfuse.ops import auto, checks, library
from commfuse.ops import gather_scatter as gs
from commfuse.ops.matmul_rs import reduce_scatter_of
from commfuse.ops.methods import method_spec
from commfuse.runtime import modes


def query_split_attention(q_SBHd, k_SBHd, v_SBHd, wo_HdD, group=None, *, causal: bool = True,
                          method: str = "commfuse", sizes=None, **opts) -> torch.Tensor:
    """``reduce_scatter(attn(q, k, v) @ wo, dim 0)`` -> ``[sizes[rank], B, D]``, run per query
    slice; ``sizes`` (rows of the sequence each rank keeps) defaults to `even_sizes`."""
    for name, t in (("q", q_SBHd), ("k", k_SBHd), ("v", v_SBHd)):
        checks.check_tensor(name, t, 4)
    if not (q_SBHd.shape == k_SBHd.shape == v_SBHd.shape):
        raise ValueError(f"q, k, v must have one shape [S, B, H, d], got {tuple(q_SBHd.shape)}, "
                         f"{tuple(k_SBHd.shape)}, {tuple(v_SBHd.shape)}")
    S, B, H, d = q_SBHd.shape
    checks.check_matmul("q (flattened heads)", q_SBHd.new_empty(0, H * d), "wo", wo_HdD)
    spec = method_spec(method, opts)
    group = checks.resolve_group(group)
    sizes = checks.check_sizes(sizes, group.size(), group.rank(), total=S)
    spec = auto.resolve(spec, "matmul_rs", (S * B, H * d, wo_HdD.shape[1]), group.size(),
                        q_SBHd)  # costed as its out-projection's GEMM -> RS
    if torch.compiler.is_compiling():  # one opaque custom op in the graph
        return query_split_op(q_SBHd, k_SBHd, v_SBHd, wo_HdD, causal, list(sizes),
                              group.group_name, library.spec_str(spec))
    return QuerySplitAttention.apply(q_SBHd, k_SBHd, v_SBHd, wo_HdD, causal, sizes, group, spec)


def _attention(q_SBHd, k_SBHd, v_SBHd, causal: bool) -> torch.Tensor:
    """Plain attention of the whole sequence -> ``o_SBX`` (the reference, and the backward)."""
    S, B, H, d = q_SBHd.shape
    o_BHSd = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q_SBHd, k_SBHd, v_SBHd)),
                                            is_causal=causal)
    return o_BHSd.permute(2, 0, 1, 3).reshape(S, B, H * d)


def _runs(pos: list[int]) -> list[tuple[int, int, int]]:
    """(index in ``pos``, first position, length) of each run of consecutive positions."""
    runs: list[list[int]] = []
    for i, p in enumerate(pos):
        if runs and p == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([i, p, 1])
    return [tuple(r) for r in runs]


def _rows_attention(q_BHRd, k_BHSd, v_BHSd, pos: list[int], causal: bool) -> torch.Tensor:
    """Attention of the query rows at sequence positions ``pos`` (host integers, so no
    device sync) over the whole sequence, one SDPA call per run of consecutive rows. A run
    from position a of n rows sees keys 0..a+n-1, the last n of them causally: SDPA's
    lower-right causal bias (``is_causal`` when a = 0), which its fused kernels take; no
    boolean mask is built."""
    outs = [q_BHRd[:, :, :0]]  # no rows (a slice of 0 rows: S < ranks): an empty output
    for i, a, n in _runs(pos):
        q = q_BHRd[:, :, i:i + n]
        if not causal:
            outs.append(F.scaled_dot_product_attention(q, k_BHSd, v_BHSd))
            continue
        k, v = k_BHSd[:, :, :a + n], v_BHSd[:, :, :a + n]  # later keys are masked out anyway
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True) if a == 0 else
                    F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, a + n)))
    return outs[-1] if len(outs) <= 2 else torch.cat(outs[1:], dim=2)


def _forward(q_SBHd, k_SBHd, v_SBHd, wo_XD, causal: bool, sizes, group, spec) -> torch.Tensor:
    S, B, H, d = q_SBHd.shape
    k_BHSd, v_BHSd = k_SBHd.permute(1, 2, 0, 3), v_SBHd.permute(1, 2, 0, 3)
    pos_S = torch.arange(S)  # on the host: the rows' positions are known from the sizes

    def partial(view) -> torch.Tensor:
        q_rows = view(q_SBHd)  # [s, B, H, d] (a slot or uneven chunk) or [W, n, B, H, d] (chunk)
        lead = q_rows.shape[:-3]
        if modes.current() == "comm_only":
            return q_rows.new_empty((*lead, B, wo_XD.shape[1]))
        q_BHRd = q_rows.reshape(-1, B, H, d).permute(1, 2, 0, 3)
        o_BHRd = _rows_attention(q_BHRd, k_BHSd, v_BHSd, view(pos_S).reshape(-1).tolist(), causal)
        o_RBX = o_BHRd.permute(2, 0, 1, 3).reshape(-1, B, H * d)
        return modes.gemm(o_RBX, wo_XD).reshape(*lead, B, wo_XD.shape[1])

    return reduce_scatter_of(partial, sizes, (B, wo_XD.shape[1]), q_SBHd, group, spec)


class QuerySplitAttention(torch.autograd.Function):
    """``out = reduce_scatter(attention(q, k, v) @ wo, 0)``, the ring run over query slices.

    Shapes: q, k, v [S, B, H, d] (the full sequence, this rank's heads; GQA already expanded),
    wo [H*d, D] (this rank's rows); returns [sizes[rank], B, D] (S/W rows when even).
    Grads: dO = all_gather(dOut) @ wo^T (dual fused op), dq, dk, dv through a recomputed
    attention, dwo = O^T @ all_gather(dOut). Extra memory: the forward's reduce-scatter
    partials (as GEMM -> RS); the backward holds O and the gathered dOut.
    """

    @staticmethod
    def forward(ctx, q, k, v, wo, causal, sizes, group, spec):
        ctx.save_for_backward(q, k, v, wo)
        ctx.causal, ctx.sizes, ctx.group, ctx.spec = causal, sizes, group, spec
        return _forward(q, k, v, wo, causal, sizes, group, spec)

    @staticmethod
    def backward(ctx, g_sBD):
        grads = query_split_backward(*ctx.saved_tensors, g_sBD, ctx.causal, ctx.sizes, ctx.group,
                                     ctx.spec)
        return (*grads, None, None, None, None)


def query_split_backward(q, k, v, wo, g_sBD, causal: bool, sizes, group, spec,
                         kernels=gs.KERNELS):
    """(dq, dk, dv, dwo) of `QuerySplitAttention`: dOut gathered fused with its GEMM by wo^T,
    the attention recomputed and backpropagated (a vjp), dwo = O^T @ all_gather(dOut)."""
    g_SBD, (go_SBX,) = kernels.ag_matmul(g_sBD.contiguous(), [wo.t()], sizes, group, spec)
    o_SBX, vjp = torch.func.vjp(lambda q, k, v: _attention(q, k, v, causal), q, k, v)
    gq, gk, gv = vjp(go_SBX)
    return gq, gk, gv, o_SBX.flatten(0, -2).t() @ g_SBD.flatten(0, -2)


# --- torch.compile: the op as a custom op (see commfuse.ops.library) -------------------------

@torch.library.custom_op("commfuse::query_split_attention", mutates_args=())
def query_split_op(q_SBHd: torch.Tensor, k_SBHd: torch.Tensor, v_SBHd: torch.Tensor,
                   wo_XD: torch.Tensor, causal: bool, sizes: list[int], group: str,
                   spec: str) -> torch.Tensor:
    return _forward(q_SBHd, k_SBHd, v_SBHd, wo_XD, causal, tuple(sizes), library.group_of(group),
                    library.parse_spec(spec))


@query_split_op.register_fake
def _(q_SBHd, k_SBHd, v_SBHd, wo_XD, causal, sizes, group, spec):
    return q_SBHd.new_empty((sizes[library.rank_of(group)], q_SBHd.shape[1], wo_XD.shape[1]))


def _setup(ctx, inputs, output):
    *qkvw, causal, sizes, group, spec = inputs
    ctx.save_for_backward(*qkvw)
    ctx.causal, ctx.sizes, ctx.group, ctx.spec = causal, tuple(sizes), group, spec


def _backward(ctx, g_sBD):
    grads = query_split_backward(*ctx.saved_tensors, g_sBD, ctx.causal, ctx.sizes, ctx.group,
                                 ctx.spec, library.KERNELS)
    return (*grads, None, None, None, None)


query_split_op.register_autograd(_backward, setup_context=_setup)

"""Query-split attention: TP attention whose out-projection reduce-scatter runs over query slices.

    out = reduce_scatter(attention(Q, K, V) @ W_o, seq)

Row-parallel Flash-RS fuses only the out-projection GEMM with the reduce-scatter. Query-split
runs the whole attention (QK^T, softmax, SV) *and* the out-projection partial per query slice
inside the Flash-RS schedule, so each step's transfer hides behind far more compute; this
rank's own query slice last. Exact: every query row sees the same keys, in the same order.

Balanced order (``order="balanced"``, the default): under causal attention a late query row
sees more keys than an early one, so contiguous slots cost unequal amounts and at each ring
step the ranks compute slices of different cost (one waits for the other). Balanced slots pair
an early and a late chunk, as zigzag ring attention does for context parallelism: the sequence
is cut into 2W chunks (`even_sizes`) and rank p's slot is chunk p followed by chunk 2W-1-p
(`balanced_split`), so every slot, and every step, costs the same. The output is then rank
p's rows of those positions, in that order.

Each run of consecutive query rows is computed as two fused SDPA blocks, the key prefix and
the causal diagonal, merged by their log-sum-exp (`commfuse.ops.attn_blocks`): no mask is
built, and the slots together cost one causal attention.

Legend: S sequence (first), B batch, H this rank's heads, d head dim, D model dim,
s = S/W one rank's slice, X = H*d.

Differentiable, with the backward fused the same way: dOut is all-gathered (the dual
all-gather, same method) and, as each slot's rows arrive, dO = dOut[slot] @ W_o^T and the
attention backward of that slot's query rows run (from the forward's saved output and
log-sum-exp: nothing is recomputed), so the gather hides behind the whole attention backward.
"""
from __future__ import annotations

import functools

import torch

from commfuse.ops import attn_blocks as blocks
from commfuse.ops import auto, checks, library
from commfuse.ops.ag_matmul import ag_matmul
from commfuse.schedule import balanced_split
from commfuse.ops.matmul_rs import reduce_scatter_of
from commfuse.ops.methods import method_spec
from commfuse.ops.prefetch import Prefetcher, posting
from commfuse.runtime import modes


ORDERS = ("balanced", "contiguous")


def query_split_attention(q_SBHd, k_SBHd, v_SBHd, wo_HdD, group=None, *, causal: bool = True,
                          order: str = "balanced", method: str = "commfuse", sizes=None,
                          prefetch=None, **opts) -> torch.Tensor:
    """``reduce_scatter(attn(q, k, v) @ wo, dim 0)`` -> ``[sizes[rank], B, D]``, run per query
    slice. ``order="contiguous"``: rank p keeps rows ``sum(sizes[:p])..`` (``sizes`` defaults
    to `even_sizes`); ``"balanced"``: rank p keeps the rows of ``balanced_split(S, W)``'s
    positions for p, in that order (``sizes``, if given, must be that split's).
    ``prefetch``: a `commfuse.ops.prefetch.Prefetcher` shared with the fused ops around this
    one; the backward posts the re-gather of the AG->GEMM before it (q|k|v's) right after its
    own last post, so that gather moves during the rest of the attention backward (eager only,
    as for GEMM -> RS)."""
    for name, t in (("q", q_SBHd), ("k", k_SBHd), ("v", v_SBHd)):
        checks.check_tensor(name, t, 4)
    if not (q_SBHd.shape == k_SBHd.shape == v_SBHd.shape):
        raise ValueError(f"q, k, v must have one shape [S, B, H, d], got {tuple(q_SBHd.shape)}, "
                         f"{tuple(k_SBHd.shape)}, {tuple(v_SBHd.shape)}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    S, B, H, d = q_SBHd.shape
    checks.check_matmul("q (flattened heads)", q_SBHd.new_empty(0, H * d), "wo", wo_HdD)
    spec = method_spec(method, opts)
    if prefetch is not None and not isinstance(prefetch, Prefetcher):
        raise TypeError(f"prefetch must be a commfuse.ops.prefetch.Prefetcher or None, "
                        f"got {type(prefetch).__name__}")
    group = checks.resolve_group(group)
    if order == "balanced":
        split = balanced_split(S, group.size())[0]
        if sizes is not None and tuple(sizes) != split:
            raise ValueError(f"order='balanced' keeps the rows {split} per rank; got sizes="
                             f"{tuple(sizes)} (use order='contiguous' for another split)")
        sizes = split
    sizes = checks.check_sizes(sizes, group.size(), group.rank(), total=S)
    # costed as its out-projection's GEMM -> RS with each slot's attention inside
    spec = auto.resolve(spec, "matmul_rs", (S * B, H * d, wo_HdD.shape[1]), group.size(),
                        q_SBHd, attention=(d, order, 1.0, B) if causal else ())
    if torch.compiler.is_compiling():  # one opaque custom op in the graph
        return query_split_op(q_SBHd, k_SBHd, v_SBHd, wo_HdD, causal, order, list(sizes),
                              group.group_name, library.spec_str(spec))[0]
    return QuerySplitAttention.apply(q_SBHd, k_SBHd, v_SBHd, wo_HdD, causal, order, sizes,
                                     group, spec, prefetch)


@functools.lru_cache(maxsize=64)
def _positions(order: str, sizes, world: int) -> torch.Tensor:
    """The sequence position of each row of the slots, in slot order (on the host; cached,
    read only)."""
    S = sum(sizes)
    return torch.tensor(balanced_split(S, world)[1]) if order == "balanced" else torch.arange(S)


def _runs(pos: torch.Tensor) -> list[tuple[int, int, int]]:
    """(index in ``pos``, first position, length) of each run of consecutive positions of
    ``pos`` (flattened)."""
    pos = pos.reshape(-1)
    if pos.numel() == 0:
        return []
    firsts = [0, *(torch.nonzero(pos.diff() != 1).flatten() + 1).tolist()]
    ends = [*firsts[1:], pos.numel()]
    return [(i, a, e - i) for i, a, e in zip(firsts, pos[firsts].tolist(), ends)]


def _bhsd(t_SBHd: torch.Tensor) -> torch.Tensor:
    """[B, H, S, d], each head's rows contiguous: every run's blocks read all of k and v
    (strided reads cost ~15 %). No copy where they already are (a view of a [B, H, L, d]
    tensor, such as `SeqLayout.natural_heads`', a KV cache's first S positions, or the copies
    the forward saves for the backward)."""
    t_BHSd = t_SBHd.permute(1, 2, 0, 3)
    if t_BHSd.stride(3) == 1 and t_BHSd.stride(2) == t_BHSd.shape[3]:
        return t_BHSd
    return t_BHSd.contiguous()


def _heads(t_SBHd: torch.Tensor) -> torch.Tensor:
    """The [B, H, S, d] view of [S, B, H, d] rows, no copy: q, dO and o are read once per run,
    and for B = 1 this is the fused kernels' own [B, S, H, d] layout."""
    return t_SBHd.permute(1, 2, 0, 3)


def _forward(q_SBHd, k_SBHd, v_SBHd, wo_XD, causal: bool, order: str, sizes, group, spec):
    """(out [sizes[rank], B, D], k, v [S, B, H, d], o [S, B, H, d], lse [B, H, S]): the result,
    and what the backward reads: k and v as the contiguous [B, H, S, d] copies the blocks read
    (viewed as [S, B, H, d]; `_bhsd` takes them as they are), the attention output and the
    log-sum-exp of every row (natural order)."""
    S, B, H, d = q_SBHd.shape
    D = wo_XD.shape[1]
    q_BHSd, k_BHSd, v_BHSd = _heads(q_SBHd), _bhsd(k_SBHd), _bhsd(v_SBHd)
    o_SBHd = q_SBHd.new_empty((S, B, H, d))
    lse_BHS = q_SBHd.new_empty((B, H, S), dtype=blocks.lse_dtype(q_SBHd.dtype))
    pos_S = _positions(order, tuple(sizes), group.size())

    def partial(view) -> torch.Tensor:
        pos = view(pos_S)  # [s] (a slot or uneven chunk) or [W, n] (an even chunk)
        out_RBD = q_SBHd.new_empty((*pos.shape, B, D))
        if modes.current() == "comm_only":
            return out_RBD
        out_XD = out_RBD.view(-1, D)
        for i, a, n in _runs(pos):  # each run: prefix + diagonal block
            o, lse = blocks.run_forward(q_BHSd[:, :, a:a + n], k_BHSd, v_BHSd, a, causal)
            o_SBHd[a:a + n], lse_BHS[:, :, a:a + n] = o.permute(2, 0, 1, 3), lse
            # the out-projection of the run's rows, straight from o (no gather of the runs)
            modes.gemm(o_SBHd[a:a + n].view(n * B, H * d), wo_XD, out=out_XD[i * B:(i + n) * B])
        return out_RBD

    out = reduce_scatter_of(partial, sizes, (B, D), q_SBHd, group, spec)
    return out, k_BHSd.permute(2, 0, 1, 3), v_BHSd.permute(2, 0, 1, 3), o_SBHd, lse_BHS


class QuerySplitAttention(torch.autograd.Function):
    """``out = reduce_scatter(attention(q, k, v) @ wo, 0)``, the ring run over query slices.

    Shapes: q, k, v [S, B, H, d] (the full sequence, this rank's heads; GQA already expanded),
    wo [H*d, D] (this rank's rows); returns [sizes[rank], B, D] (this rank's rows of the
    order). Grads, per slot as dOut's gather brings it: dO = dOut[slot] @ wo^T, dq, dk, dv of
    the slot's query rows (flash-attention backward from the saved o, lse), dwo += O[slot]^T
    @ dOut[slot]. Saved: q, wo, k and v as the forward's [B, H, S, d] copies (in place of the
    inputs, so not read twice), o [S, B, H, d] and lse [B, H, S] (what SDPA's backward keeps
    too). Extra memory: the forward's reduce-scatter partials (as GEMM -> RS); the
    backward the gathered dOut and dk, dv accumulators.
    """

    @staticmethod
    def forward(ctx, q, k, v, wo, causal, order, sizes, group, spec, prefetcher=None):
        out, k, v, o, lse = _forward(q, k, v, wo, causal, order, sizes, group, spec)
        ctx.save_for_backward(q, k, v, wo, o, lse)
        ctx.args = causal, order, sizes, group, spec
        # the AG->GEMM just before this op (q|k|v): its re-gather is posted by this backward
        ctx.ticket = None if prefetcher is None else prefetcher.claim()
        return out

    @staticmethod
    def backward(ctx, g_sBD):
        ticket, ctx.ticket = ctx.ticket, None
        grads = posting(ticket, lambda after_posts: query_split_backward(
            *ctx.saved_tensors, g_sBD, *ctx.args, after_posts=after_posts))
        return (*grads, None, None, None, None, None, None)


def query_split_backward(q, k, v, wo, o_SBHd, lse_BHS, g_sBD, causal: bool, order: str, sizes,
                         group, spec, after_posts=None):
    """(dq, dk, dv [S, B, H, d], dwo) of `QuerySplitAttention`, fused with the all-gather of
    dOut: each arriving slot's rows feed dO = dOut[slot] @ wo^T, the attention backward of
    those query rows and dwo += O[slot]^T dOut[slot] (slots summed in this rank's gather
    order). ``after_posts()`` runs right after that gather's last post
    (`commfuse.ops.prefetch`)."""
    S, B, H, d = q.shape
    q_BHSd, k_BHSd, v_BHSd, o_BHSd = _heads(q), _bhsd(k), _bhsd(v), _heads(o_SBHd)
    dq_SBHd = q.new_empty((S, B, H, d))  # every row is written once: by its run
    dk_SBHd, dv_SBHd = q.new_zeros((S, B, H, d)), q.new_zeros((S, B, H, d))
    dk_BHSd, dv_BHSd = _heads(dk_SBHd), _heads(dv_SBHd)
    dwo = []
    pos_S = _positions(order, tuple(sizes), group.size())
    wo_DX = wo.t()

    def consume(view, g_RBD) -> None:
        if modes.current() == "comm_only" or g_RBD.shape[0] == 0:
            return
        runs = _runs(view(pos_S))
        g_XD = g_RBD.reshape(-1, g_RBD.shape[-1])
        go_BHRd = _heads(modes.gemm(g_RBD, wo_DX).view(-1, B, H, d))
        for i, a, n in runs:
            o_nX, g_nD = o_SBHd[a:a + n].view(n * B, H * d), g_XD[i * B:(i + n) * B]
            if dwo:
                dwo[0].addmm_(o_nX.t(), g_nD)
            else:
                dwo.append(o_nX.t() @ g_nD)
            dq_SBHd[a:a + n] = blocks.run_backward(
                go_BHRd[:, :, i:i + n], q_BHSd[:, :, a:a + n], k_BHSd, v_BHSd,
                o_BHSd[:, :, a:a + n], lse_BHS[:, :, a:a + n], a, causal, dk_BHSd,
                dv_BHSd).permute(2, 0, 1, 3)

    ag_matmul(g_sBD.contiguous(), [], sizes, group, spec, consume=consume,
              after_posts=after_posts)
    return dq_SBHd, dk_SBHd, dv_SBHd, dwo[0] if dwo else torch.zeros_like(wo)


# --- torch.compile: the op as custom ops (see commfuse.ops.library) ------------------------

@torch.library.custom_op("commfuse::query_split_attention", mutates_args=())
def query_split_op(q_SBHd: torch.Tensor, k_SBHd: torch.Tensor, v_SBHd: torch.Tensor,
                   wo_XD: torch.Tensor, causal: bool, order: str, sizes: list[int], group: str,
                   spec: str) -> list[torch.Tensor]:
    """[out, o, lse] (o and lse are saved for the backward)."""
    out, _, _, o, lse = _forward(q_SBHd, k_SBHd, v_SBHd, wo_XD, causal, order, tuple(sizes),
                                 library.group_of(group), library.parse_spec(spec))
    return [out, o, lse]


@query_split_op.register_fake
def _(q_SBHd, k_SBHd, v_SBHd, wo_XD, causal, order, sizes, group, spec):
    S, B, H, d = q_SBHd.shape
    return [q_SBHd.new_empty((sizes[library.rank_of(group)], B, wo_XD.shape[1])),
            q_SBHd.new_empty((S, B, H, d)),
            q_SBHd.new_empty((B, H, S), dtype=blocks.lse_dtype(q_SBHd.dtype))]


@torch.library.custom_op("commfuse::query_split_attention_backward", mutates_args=())
def query_split_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            wo: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                            g_sBD: torch.Tensor, causal: bool, order: str, sizes: list[int],
                            group: str, spec: str) -> list[torch.Tensor]:
    grads = query_split_backward(q, k, v, wo, o, lse, g_sBD, causal, order, tuple(sizes),
                                 library.group_of(group), library.parse_spec(spec))
    return [t.contiguous() for t in grads]  # the strides the fake kernel promises


@query_split_backward_op.register_fake
def _(q, k, v, wo, o, lse, g_sBD, causal, order, sizes, group, spec):
    return [t.new_empty(t.shape) for t in (q, k, v, wo)]


def _setup(ctx, inputs, output):
    *qkvw, causal, order, sizes, group, spec = inputs
    ctx.save_for_backward(*qkvw, output[1], output[2])
    ctx.args = causal, order, list(sizes), group, spec


def _backward(ctx, grads):
    return (*query_split_backward_op(*ctx.saved_tensors, grads[0], *ctx.args),
            None, None, None, None, None)


query_split_op.register_autograd(_backward, setup_context=_setup)

"""The interleaved prefill (``InferenceLlama(prefill_chunks=n)``, docs/design.md,
"Interleaved prefill").

The fused ops hide a transfer only behind the GEMM beside it. Here the prompt is cut into n
chunks of positions, and each chunk runs through all blocks as a coroutine (`_chunk`) that
yields at every collective. `prefill` posts each collective as it is yielded (async: gloo
P2P through the sender threads, NCCL on its stream) and resumes the chunks in turn, each
after waiting for its own, so while one chunk's collective moves, the next computes:
transfers hide behind all of a block's compute (attention and the memory-bound kernels too).

Chunk c attends to the cache's keys of positions up to its end: the diagonal block causal,
merged with the prefix block by their log-sum-exp (`commfuse.ops.attn_blocks.run_forward`);
where a block's sliding window hides some of those keys, one attention under the window's
mask (`commfuse.models.llama.window_mask`).
The chunks run in order at every step, so chunk c's keys are in the cache before chunk c+1
reads them. On 2 ranks the chunks run replicated (two all-reduces per block), on more
sequence-parallel (two all-gathers and two reduce-scatters); see `_chunk`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from commfuse.errors import CommFuseError
from commfuse.models.llama import apply_rope
from commfuse.ops import attn_blocks
from commfuse.ops.binding import even_sizes
from commfuse.runtime import modes

TAG = 7200  # chunk c's collectives use tag TAG + c


def chunk_bounds(seq: int, chunks: int) -> list[int]:
    """The chunks' first positions and the end: ``chunks + 1`` numbers, 0 to ``seq``."""
    bounds = [0]
    for n in even_sizes(seq, chunks):
        bounds.append(bounds[-1] + n)
    return bounds


def replicated(world: int) -> bool:
    """Whether the chunks run replicated (all-reduces; `_chunk`): on 2 ranks, where an
    all-reduce moves the bytes of a reduce-scatter and an all-gather."""
    return world == 2


def prefill(model, tokens_BS, lengths_B, cache, chunks: int):
    """``model``'s prefill (`InferenceLlama.prefill`) in ``chunks`` chunks of positions,
    interleaved at every collective (module doc); the logits."""
    B, S = tokens_BS.shape
    T, r = model.world, model.rank
    rep = replicated(T)
    bounds = chunk_bounds(S, chunks)
    device = tokens_BS.device
    transport = None
    if model.group is not None:
        timeout = model.opts.get("timeout")
        transport = modes.transport_class(device)(model.group, device, timeout)
    coros = [_chunk(model, tokens_BS, cache, a, b, rep)
             for a, b in zip(bounds, bounds[1:])]
    posted: list = [None] * chunks
    outs: list = [None] * chunks

    def advance(c: int, result) -> None:
        try:
            kind, inp, sizes = coros[c].send(result)
        except StopIteration as done:
            outs[c], posted[c] = done.value, None
            return
        inp = inp.contiguous()
        if transport is None:  # one process: the collective of one rank is the identity
            posted[c] = (None, inp, kind)
            return
        if kind == "all_reduce":  # in place: the sum in rank order, the same on every rank
            out = inp
        else:
            rows = sum(sizes) if kind == "all_gather" else sizes[r]
            out = inp.new_empty((rows, *inp.shape[1:]))
        work = transport.launch(kind, out, inp, TAG + c,
                                sizes=None if kind == "all_reduce" else sizes)
        posted[c] = (work, out, kind)

    for c in range(chunks):
        advance(c, None)
    while any(p is not None for p in posted):
        for c in range(chunks):
            if posted[c] is None:
                continue
            work, out, kind = posted[c]
            if work is not None:
                try:
                    transport.wait(work)
                except Exception as e:
                    raise CommFuseError(
                        f"interleaved prefill, rank {r} of {T}: chunk {c}'s "
                        f"{kind.replace('_', '-')} did not complete: {e}") from e
            advance(c, out)
    cache.commit(lengths_B)
    h_BD = outs[0].new_zeros(B, model.cfg.dim)
    for c, (a, b) in enumerate(zip(bounds, bounds[1:])):  # my rows of each chunk
        start = a if rep else a + sum(even_sizes(b - a, T)[:r])
        model._take_last(h_BD, outs[c].transpose(0, 1), lengths_B - 1 - start)
    if rep:  # every rank holds every row: bitwise the same logits already
        return model.output(model.norm(h_BD))
    return model._logits(h_BD)


def _chunk(model, tokens_BS: torch.Tensor, cache, c0: int, c1: int, replicated: bool):
    """Positions c0..c1 of every prompt through the blocks, as a coroutine: it yields each
    collective as ``(kind, tensor, sizes)``, is sent back the result, and returns its rows
    after the last block, rows first ([s, B, D]: the dim the collectives split).

    Sequence-parallel (``replicated`` False): this rank holds ``even_sizes(c1 - c0,
    T)[rank]`` rows of the chunk; each block all-gathers them before q|k|v and gate|up
    ([n, B, D] back) and reduce-scatters the out-projection's and down's partial sums (my
    s rows back). Replicated: every rank holds all n rows, q|k|v and gate|up are local
    GEMMs, and the two partial sums are all-reduced ([n, B, D] back, summed in rank
    order: the reduce-scatter's sums, so the same bits as sequence-parallel). Per block
    that is two collectives instead of four, each followed by compute (the all-gather
    after a reduce-scatter waits for it with no compute between), for the same bytes on
    2 ranks ((T-1) n D each way per all-reduce, against 2 (T-1) / T n D for a
    reduce-scatter and an all-gather), at the cost of the norms and residual adds over
    all n rows."""
    B = tokens_BS.shape[0]
    n, sizes = c1 - c0, even_sizes(c1 - c0, model.world)
    a, s = (c0, n) if replicated else (c0 + sum(sizes[:model.rank]), sizes[model.rank])
    # rows first and contiguous: a strided [s, B, D] @ W would run as a batched GEMM
    x_sBD = model.tok_emb(tokens_BS[:, a:a + s].t())
    cos, sin = model.cos_LK[c0:c1], model.sin_LK[c0:c1]  # [n, K]: every sequence alike
    heads = lambda t_nBX: model._heads(t_nBX.transpose(0, 1), B, n)  # [B, n, heads, K]
    reduce = "all_reduce" if replicated else "reduce_scatter"
    for i, blk in enumerate(model.blocks):
        g_nBD = blk.attn_norm(x_sBD)
        if not replicated:
            g_nBD = yield "all_gather", g_nBD, sizes
        q, k, v = map(heads, blk.qkv(*(g_nBD @ w.t() for w in (blk.wq, blk.wk, blk.wv))))
        q, k = blk.qk_heads(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_BgSK, v_BgSK = cache.prefill_kv(i, tokens_BS.shape[1])
        k_BgSK[:, :, c0:c1] = k.transpose(1, 2)
        v_BgSK[:, :, c0:c1] = v.transpose(1, 2)
        k_BHLK, v_BHLK = model._expand(k_BgSK[:, :, :c1], v_BgSK[:, :, :c1], q.size(2), 1)
        if blk.window is not None and blk.window < c1:  # the window hides early keys
            pos = torch.arange(c1, device=q.device)
            o_BHnK = F.scaled_dot_product_attention(q.transpose(1, 2), k_BHLK, v_BHLK,
                                                    attn_mask=blk.mask(pos[c0:], pos))
        else:
            o_BHnK = attn_blocks.run_forward(q.transpose(1, 2), k_BHLK, v_BHLK, c0, True)[0]
        p_nBD = o_BHnK.permute(2, 0, 1, 3).reshape(n, B, -1) @ blk.wo.t()
        x_sBD = (yield reduce, p_nBD, sizes).add_(x_sBD)  # y + x: the bits of x + y
        g_nBD = blk.mlp_norm(x_sBD)
        if not replicated:
            g_nBD = yield "all_gather", g_nBD, sizes
        h_nBf = F.silu(g_nBD @ blk.w_gate.t()) * (g_nBD @ blk.w_up.t())
        x_sBD = (yield reduce, h_nBf @ blk.w_down.t(), sizes).add_(x_sBD)
    return x_sBD

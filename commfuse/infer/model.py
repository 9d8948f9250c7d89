"""KV-cached inference of `commfuse.models.llama.Llama`, tensor-parallel over heads.

`InferenceLlama` cuts a plain Llama the way `commfuse.parallel.tensor` does for training (rank
r holds the head-group rows of wq / wk / wv, the matching columns of wo, rows r*F/T.. of
w_gate / w_up and the matching columns of w_down) and runs two kinds of forward with the same
weights and the same per-block code:

    prefill   the prompts [B, S] (right-padded): sequence-parallel, x_BsD between blocks
              (`even_sizes(S, T)`, any S; with query-split the balanced order of
              `commfuse.parallel.layout.SeqLayout`); per block
                  [AG -> GEMM] q|k|v of all S tokens for my heads       (fused, one call)
                  attention (causal; or query-split: attention + out-proj per query slice
                  inside the reduce-scatter ring), k and v written to the cache
                  [GEMM -> RS] out-proj, summed over the group, my rows back
                  [AG -> GEMM] gate|up, SwiGLU, [GEMM -> RS] down
              Or interleaved (``prefill_chunks`` n > 1): the prompt in n chunks, one
              chunk's collectives moving while the next computes
              (`commfuse.infer.interleave`); under "auto" the faster, measured
              (`commfuse.infer.plans`).
    decode    one new token per sequence: the B tokens are the rows the fused ops split
              (`even_sizes(B, T)`, a rank may have none), each attends to its own sequence's
              cache up to its position. Or (decode method "allreduce") every rank holds all B
              rows: q|k|v and gate|up are local GEMMs, the out-proj and down partial sums one
              all-reduce each: two collectives per block instead of four fused ops, which
              wins when a step is all latency (B small). "auto" takes whichever the cost
              model predicts faster for B (`commfuse.infer.predict.decode_choice`).

The embedding, final norm and output head are replicated: a rank embeds only its rows, and the
last hidden state of each sequence is summed over the group (one small all-reduce of [B, D],
zeros but the owner's row, so exact; `_all_reduce`) before the head, so every rank holds bitwise the same
logits and samples the same token from the same seed without another collective.

Padding: prompts are right-padded to the longest; causal attention never lets a real token
see a pad after it, so prefill needs no mask (and query-split attention stays exact). Each
sequence then continues at its own position (its length), overwriting its pad slots in the
cache; decode masks the keys past each sequence's position.

Architectures (`commfuse.models.llama.config_from_hf`: transformers Llama, Mistral, Qwen2,
Qwen3): Qwen2's q/k/v biases are cut with their weights' rows and added after the
column-parallel GEMM; Qwen3's q_norm / k_norm act on each head, so every rank holds them
whole and norms its own heads before RoPE. A sliding window W (Mistral; Qwen2/Qwen3 on the
layers their config says) masks prefill attention to ``q - W < k <= q`` (the interleaved
prefill too; query-split, causal over the whole prompt, does not run where W < S), and its
layer's cache is a ring of W slots (`commfuse.infer.cache`).

Shape suffixes: B batch, S prompt length, s = this rank's rows, L cache length, D model,
h / g this rank's query / kv heads, K head dim, f = F/T, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.errors import CommFuseError
from commfuse.infer import plans
from commfuse.infer.block import Block, rope
from commfuse.infer.cache import KVCache
from commfuse.models.llama import Llama, rope_cos_sin
from commfuse.ops.attention import query_split_attention
from commfuse.ops.auto import choose_query_split
from commfuse.ops.binding import even_sizes
from commfuse.ops.fused import fused_all_gather_matmul, fused_matmul_reduce_scatter
from commfuse.parallel.layout import SeqLayout

TAG = 7101  # P2P tag of decode's all-reduce (method "allreduce")


class InferenceLlama(nn.Module):
    """``model`` (a plain `Llama`, the same weights on every rank) cut over ``group`` (None:
    one process, the reference) for KV-cached prefill and decode.

    ``method`` and ``opts``: the fused ops' method for prefill and decode (`commfuse.ops.fused`;
    "auto" picks per shape, so decode's B-row GEMMs may get another method than prefill's, and
    decode may run replicated with all-reduces); ``decode_method``: decode's instead, if given
    (also "allreduce": replicated rows, an all-reduce after each row-parallel GEMM).
    ``query_split``: prefill attention and out-projection per query slice inside the
    reduce-scatter ring (`query_split_attention`), on the balanced order; None (default):
    under method "auto" where the cost model predicts it faster for the prompt's shape
    (`commfuse.ops.auto.choose_query_split` on the forward alone, CPU only, as in training),
    else not.
    ``prefill_chunks``: n > 1 prefills interleaved in n chunks (the fused ops' method and
    ``query_split`` do not apply); 1: never; None: under "auto" the faster of the two, timed
    on the first prompts of each shape (`commfuse.infer.plans`; ``tune=False``: the model's).
    """

    def __init__(self, model: Llama, group=None, method: str = "auto",
                 query_split: bool | None = None,
                 decode_method: str | None = None, *, prefill_chunks: int | None = None,
                 tune: bool = True, **opts):
        super().__init__()
        cfg = self.cfg = model.cfg
        self.group = group if group is not None and group.size() > 1 else None
        T, r = (group.size(), group.rank()) if self.group is not None else (1, 0)
        for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads),
                        ("ffn_hidden", cfg.ffn_hidden)):
            if n % T:
                raise ValueError(f"{what} ({n}) must be divisible by the TP group size ({T})")
        self.world, self.rank = T, r
        self.kv_heads = cfg.n_kv_heads // T
        self.method, self.decode_method, self.opts = method, decode_method or method, dict(opts)
        self.query_split = query_split
        self.prefill_chunks = plans.checked_chunks(prefill_chunks)
        self.tuner = plans.PlanTuner() if tune else None
        self.blocks = nn.ModuleList(Block(layer, r, T) for layer in model.layers)
        self.tok_emb, self.norm, self.output = model.tok_emb, model.norm, model.output
        cos, sin = rope_cos_sin(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta,
                                model.tok_emb.weight.device, cfg.rope_scaling)
        self.register_buffer("cos_LK", cos, persistent=False)
        self.register_buffer("sin_LK", sin, persistent=False)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` positions."""
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"{max_len} positions exceed max_seq_len={self.cfg.max_seq_len}")
        w = self.tok_emb.weight
        return KVCache(self.cfg.n_layers, batch, self.kv_heads, max_len, self.cfg.head_dim,
                       w.dtype, w.device, [blk.window for blk in self.blocks])

    # --- the fused ops, or plain GEMMs in one process ----------------------------------------

    def _col(self, x_BsD, ws, sizes, method):
        """Column-parallel: ``all_gather(x, 1) @ w^T`` for each w (one fused call)."""
        if self.group is None:
            return [x_BsD @ w.t() for w in ws]
        return fused_all_gather_matmul(x_BsD, [w.t() for w in ws], 1, self.group, sizes=sizes,
                                       return_A=False, method=method, **self.opts)[1]

    def _row(self, h_BSf, w, sizes, method):
        """Row-parallel: ``reduce_scatter(h @ w^T, 1)``, my ``sizes[rank]`` rows."""
        if self.group is None:
            return h_BSf @ w.t()
        return fused_matmul_reduce_scatter(h_BSf, w.t(), "sum", 1, self.group, sizes=sizes,
                                           method=method, **self.opts)

    def _block(self, blk: Block, x_BsD, col, row, attend):
        """One block; ``col(x, ws)`` / ``row(h, w)``: the column- / row-parallel GEMMs."""
        q, k, v = blk.qkv(*col(blk.attn_norm(x_BsD), [blk.wq, blk.wk, blk.wv]))
        x_BsD = x_BsD + attend(blk, q, k, v)
        g_BSf, u_BSf = col(blk.mlp_norm(x_BsD), [blk.w_gate, blk.w_up])
        return x_BsD + row(F.silu(g_BSf) * u_BSf, blk.w_down)

    def _heads(self, t, B, S):
        return t.reshape(B, S, -1, self.cfg.head_dim)

    def _expand(self, k, v, h: int, dim: int):
        n_rep = h // k.size(dim)  # GQA: query head j reads kv head j // n_rep
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim), v.repeat_interleave(n_rep, dim)
        return k, v

    def _logits(self, h_BD: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, V] from each sequence's last hidden state; ``h_BD`` holds
        this rank's rows and zeros elsewhere: summed over the group, so the same everywhere."""
        return self.output(self.norm(self._all_reduce(h_BD)))

    # --- prefill and decode ------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, tokens_BS: torch.Tensor, lengths_B: torch.Tensor, cache: KVCache):
        """Run the right-padded prompts ``tokens_BS`` (sequence b is its first ``lengths_B[b]``
        tokens, 1 <= lengths <= S) into the empty ``cache``; the logits [B, V] of each
        sequence's next token (the same on every rank)."""
        B, S = tokens_BS.shape
        lengths_B = lengths_B.to(torch.long).to(tokens_BS.device)
        if int(cache.lengths_B.max()) != 0:
            raise ValueError("prefill needs an empty cache (new_cache)")
        if S > cache.max_len or lengths_B.shape != (B,) or not (
                (lengths_B >= 1) & (lengths_B <= S)).all():
            raise ValueError(f"prompts [{B}, {S}] with lengths {lengths_B.tolist()} do not fit "
                             f"a cache of {cache.max_len} positions")
        return plans.run_prefill(self, tokens_BS, lengths_B, cache)

    def _prefill_fused(self, tokens_BS, lengths_B, cache: KVCache):
        """`prefill` on the fused ops (sequence-parallel, query-split where it runs)."""
        B, S = tokens_BS.shape
        # query-split runs on the balanced order (`SeqLayout`): the prompt permuted so that
        # each rank's rows are chunk r and chunk 2T-1-r of 2T, every ring step costing the same
        layout = SeqLayout(self.rank, self.world)
        layout.begin(S, self.runs_query_split(self.method, S, B, self.tok_emb.weight),
                     tokens_BS.device)
        sizes = layout.split(S)
        off = sum(sizes[:self.rank])
        cos, sin = (layout.permute(t[None, :S]) for t in (self.cos_LK, self.sin_LK))
        pos_S = torch.arange(S, device=tokens_BS.device)
        layer = iter(range(self.cfg.n_layers))

        def attend(blk, q, k, v):
            i = next(layer)
            # RoPE on the gathered rows in the layout's order (cos / sin permuted alike); the
            # cache, and attention's keys, in the natural order: k and v are read back from it
            q, k, v = (self._heads(t, B, S) for t in (q, k, v))
            q, k = blk.qk_heads(q, k)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k_BHSd, v_BHSd = cache.prefill_kv(i, S)
            for dst, src in ((k_BHSd, k), (v_BHSd, v)):
                if layout.positions is None:
                    dst.copy_(src.transpose(1, 2))
                else:
                    dst.index_copy_(2, layout.positions, src.transpose(1, 2))
            k, v = self._expand(k_BHSd, v_BHSd, q.size(2), 1)
            if layout.query_split:  # attention + out-proj per query slice, in the RS ring
                o_SBD = query_split_attention(layout.natural_heads(q), k.permute(2, 0, 1, 3),
                                              v.permute(2, 0, 1, 3), blk.wo.t(), self.group,
                                              order="balanced", method=self.method,
                                              **self.opts)
                return o_SBD.transpose(0, 1)
            mask = None if blk.window is None or blk.window >= S else blk.mask(pos_S, pos_S)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=mask is None,
                                               attn_mask=mask)
            return row(o.transpose(1, 2).reshape(B, S, -1), blk.wo)

        col = lambda x, ws: self._col(x, ws, sizes, self.method)
        row = lambda h, w: self._row(h, w, sizes, self.method)
        x_BsD = self.tok_emb(layout.permute(tokens_BS)[:, off:off + sizes[self.rank]])
        for blk in self.blocks:
            x_BsD = self._block(blk, x_BsD, col, row, attend)
        cache.commit(lengths_B)
        last_B = lengths_B - 1  # each sequence's last token: its row in the layout's order,
        if layout.inverse is not None:
            last_B = layout.inverse[last_B]
        h_BD = x_BsD.new_zeros(B, x_BsD.shape[-1])
        self._take_last(h_BD, x_BsD, last_B - off)  # then in my rows
        return self._logits(h_BD)

    @staticmethod
    def _take_last(h_BD: torch.Tensor, x_BsD: torch.Tensor, last_B: torch.Tensor) -> None:
        """Copy into ``h_BD`` each sequence's row ``last_B`` of ``x_BsD`` where this rank
        holds it (0 <= last_B < s)."""
        idx = ((last_B >= 0) & (last_B < x_BsD.shape[1])).nonzero().flatten()
        h_BD[idx] = x_BsD[idx, last_B[idx]]

    @torch.no_grad()
    def decode(self, tokens_B: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append one token per sequence at its position ``cache.lengths_B``; the logits [B, V]
        of the next (the same on every rank)."""
        B = tokens_B.shape[0]
        pos_B = cache.lengths_B
        if int(pos_B.max()) >= cache.max_len:
            raise ValueError(f"the cache is full ({cache.max_len} positions)")
        method = plans.decode_method(self, B, tokens_B)
        if method == "allreduce":  # every rank all B rows: local GEMMs, all-reduced partials
            sizes, off = (B,), 0
            col = lambda x, ws: [x @ w.t() for w in ws]
            row = lambda h, w: self._all_reduce(h @ w.t())
        else:  # the B new tokens are the rows the fused ops split
            sizes = even_sizes(B, self.world)
            off = sum(sizes[:self.rank])
            col = lambda x, ws: self._col(x, ws, sizes, method)
            row = lambda h, w: self._row(h, w, sizes, method)
        mine = sizes[self.rank] if method != "allreduce" else B
        L = int(pos_B.max()) + 1
        cos, sin = self.cos_LK[pos_B][:, None], self.sin_LK[pos_B][:, None]
        key_L = torch.arange(L, device=pos_B.device)
        masks = {}  # per (window, ring): the keys each sequence sees [B, 1, 1, L or W]

        def visible(i: int, blk: Block) -> torch.Tensor:
            key = (blk.window, cache.ring[i])
            if key not in masks:
                ring = cache.visible(i, pos_B)
                masks[key] = (ring if ring is not None else blk.mask(pos_B, key_L))[:, None, None]
            return masks[key]

        ar_B = torch.arange(B, device=pos_B.device)
        layer = iter(range(self.cfg.n_layers))

        def attend(blk, q, k, v):
            i = next(layer)
            q, k, v = self._heads(q, B, 1), self._heads(k, B, 1), self._heads(v, B, 1)
            q, k = blk.qk_heads(q, k)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            slot_B = cache.slots(i, pos_B)
            cache.k[i][ar_B, :, slot_B] = k[:, 0]
            cache.v[i][ar_B, :, slot_B] = v[:, 0]
            k_BgLK, v_BgLK = self._expand(*cache.keys(i, L), q.size(2), 1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k_BgLK, v_BgLK,
                                               attn_mask=visible(i, blk))
            return row(o.transpose(1, 2).reshape(1, B, -1), blk.wo)

        x_1bD = self.tok_emb(tokens_B[None, off:off + mine])
        for blk in self.blocks:
            x_1bD = self._block(blk, x_1bD, col, row, attend)
        cache.lengths_B += 1
        if method == "allreduce":  # already the same on every rank
            return self.output(self.norm(x_1bD[0]))
        h_BD = x_1bD.new_zeros(B, x_1bD.shape[-1])
        h_BD[off:off + mine] = x_1bD[0]
        return self._logits(h_BD)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in one round, in place: every rank's partial sent point to
        point (gloo's own all-reduce is several times slower for decode's few KiB) and added in
        rank order, so the sum is bitwise the same on every rank."""
        from commfuse.runtime import modes

        if self.group is None or modes.current() == "compute_only":
            return t
        t = t.contiguous()
        self._exchange("all_reduce", t, t, TAG, "decode all-reduce")
        return t

    def _gather(self, t: torch.Tensor, tag: int, what: str) -> torch.Tensor:
        """Every rank's ``t``, [T, *t.shape], in one exchange with each peer."""
        parts = t.new_empty((self.world, *t.shape))
        self._exchange("all_gather", parts, t.unsqueeze(0).contiguous(), tag, what)
        return parts

    def _exchange(self, kind: str, out: torch.Tensor, inp: torch.Tensor, tag: int,
                  what: str) -> None:
        """The collective ``kind`` point to point (`commfuse.runtime.collectives`, "p2p"), within
        the timeout; `CommFuseError` naming ``what`` if a peer does not take part."""
        from commfuse.runtime import collectives, deadlines

        work = collectives.launch(kind, out, inp, self.group, tag, "p2p")
        try:  # CPU: the host waits; CUDA: the stream does (NCCL's watchdog, or ours)
            deadlines.wait(work, self.group, inp.device, self.opts.get("timeout") or None)
        except Exception as e:
            raise CommFuseError(f"{what} on rank {self.rank}: {e}") from e

    def windowed(self, seq: int) -> bool:
        """Whether some block's sliding window is shorter than ``seq`` (so it matters)."""
        return any(b.window is not None and b.window < seq for b in self.blocks)

    def runs_query_split(self, method: str, seq: int, batch: int, like: torch.Tensor) -> bool:
        """Whether the prefill of ``batch`` prompts of ``seq`` tokens with ``method`` runs
        query-split attention (``query_split``, or the cost model's choice under "auto")."""
        if self.group is None:
            return False
        if self.windowed(seq):
            if self.query_split:
                raise ValueError(f"query-split attention is causal over the whole prompt: not "
                                 f"with a sliding window shorter than the prompt ({seq} tokens, "
                                 f"windows {sorted({b.window for b in self.blocks} - {None})})")
            return False
        if self.query_split is not None:
            return self.query_split
        cfg = self.cfg
        return method == "auto" and choose_query_split(
            seq, batch, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, self.world, like,
            backward=False)

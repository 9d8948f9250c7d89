"""Tensor parallelism with sequence parallelism (Megatron TPSP) over the TP group of T ranks.

Between blocks the activations are sequence-sharded, x_BsD with s = S/T (sequence dim 1).
Per block (docs/design.md, "Where each op goes in a model"):

    attn_norm (local shard, replicated weight)
    [AG -> GEMM]  q|k|v = all_gather(x_BsD, 1) @ [wq_r^T, wk_r^T, wv_r^T]    one fused call
    attention on the full sequence for this rank's heads
    [GEMM -> RS]  reduce_scatter(o_BSh @ wo_r^T, 1)                           row-parallel
    mlp_norm (local shard)
    [AG -> GEMM]  g|u = all_gather(x_BsD, 1) @ [w_gate_r^T, w_up_r^T]         one fused call
    SwiGLU
    [GEMM -> RS]  reduce_scatter(h_BSf @ w_down_r^T, 1)

Rank r holds the head-group rows of wq / wk / wv (heads [r*H/T, (r+1)*H/T), kv heads likewise;
GQA needs n_kv_heads divisible by T), the matching columns of wo, the rows r*F/T.. of w_gate /
w_up and the matching columns of w_down. Their backward passes are the dual fused ops (the op
contracts): no TP gradient needs another collective. With a `commfuse.ops.prefetch.Prefetcher`
(``ParallelDims.regather_prefetch``, on by default) each GEMM->RS's backward posts the re-gather
of the AG->GEMM before it ahead, so it moves during the SDPA / SwiGLU backward. The embedding and the output head are
vocabulary-parallel (`commfuse.parallel.vocab`, local gradients); the norms are replicated and
their gradients summed over the TP group (`commfuse.parallel.grad_sync`).

Shape suffixes: B batch, S sequence, s = S/T, D model, H/G heads / kv heads, h = H/T,
g = G/T, K head dim, F ffn hidden, f = F/T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.ops.fused import fused_all_gather_matmul, fused_matmul_reduce_scatter
from commfuse.models.llama import Attention, MLP, apply_rope
from commfuse.ops import auto
from commfuse.ops.attention import query_split_attention
from commfuse.parallel.data import gather_rows, regathered, weight
from commfuse.parallel.layout import SeqLayout

_CONTIGUOUS = SeqLayout(0, 1)  # a block used without a model: even, contiguous shards


def rope_and_expand(q_BSHK, k_BSGK, v_BSGK, cos_SK, sin_SK):
    """RoPE on q and k, kv heads repeated for GQA (query head h reads kv head h // n_rep)."""
    q_BSHK, k_BSGK = apply_rope(q_BSHK, cos_SK, sin_SK), apply_rope(k_BSGK, cos_SK, sin_SK)
    n_rep = q_BSHK.size(2) // k_BSGK.size(2)
    if n_rep > 1:
        k_BSGK, v_BSGK = k_BSGK.repeat_interleave(n_rep, 2), v_BSGK.repeat_interleave(n_rep, 2)
    return q_BSHK, k_BSGK, v_BSGK


def causal_attention(q_BSHK, k_BSGK, v_BSGK, cos_SK, sin_SK) -> torch.Tensor:
    """The reference model's attention math (RoPE, GQA, causal SDPA) -> o_BSHK."""
    q, k, v = (t.transpose(1, 2) for t in rope_and_expand(q_BSHK, k_BSGK, v_BSGK, cos_SK, sin_SK))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[0] // world
    return w[rank * n:(rank + 1) * n]


def _cols(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[1] // world
    return w[:, rank * n:(rank + 1) * n]


class TPAttention(nn.Module):
    """Column-parallel q/k/v (one fused AG->GEMM) and row-parallel out-proj (GEMM->RS)."""

    def __init__(self, attn: Attention, tp_group, op_kwargs: dict, dp_group=None,
                 query_split: bool | None = None, layout=None, prefetch=None):
        super().__init__()
        self.layout = layout  # the sequence split (commfuse.parallel.SeqLayout); None: even
        self.prefetch = prefetch  # a commfuse.ops.prefetch.Prefetcher shared by the model
        T, r = tp_group.size(), tp_group.rank()
        self.query_split = query_split
        if attn.wk.weight.shape[0] % (T * attn.head_dim):
            raise ValueError(f"n_kv_heads ({attn.wk.weight.shape[0] // attn.head_dim}) must be "
                             f"divisible by tp ({T})")
        self.group, self.op_kwargs, self.head_dim = tp_group, dict(op_kwargs), attn.head_dim
        self.heads = attn.wq.weight.shape[0] // attn.head_dim  # of the whole model
        self.kv_heads, self.dim = attn.wk.weight.shape[0] // attn.head_dim, attn.wo.weight.shape[0]
        self.dp_group = dp_group
        for name in ("wq", "wk", "wv"):  # head-group rows
            setattr(self, name, weight(_rows(attn.get_submodule(name).weight, r, T), dp_group,
                                       op_kwargs, name, "seq"))
        self.wo = weight(_cols(attn.wo.weight, r, T), dp_group, op_kwargs, "wo", "seq")

    def forward(self, x_BsD, cos_SK, sin_SK):
        # under DP the gathered weights are saved as shards, gathered again in backward
        with regathered(self.wq, self.wk, self.wv, self.wo) as ws:
            return self._forward(x_BsD, cos_SK, sin_SK, *ws)

    def _forward(self, x_BsD, cos_SK, sin_SK, wq, wk, wv, wo):
        layout = self.layout if self.layout is not None else _CONTIGUOUS
        # the gather of the next sequence slice hides behind the q|k|v GEMMs of this one
        _, (q, k, v) = fused_all_gather_matmul(x_BsD, [wq.t(), wk.t(), wv.t()], 1, self.group,
                                               sizes=layout.sizes, return_A=False,
                                               prefetch=self.prefetch, **self.op_kwargs)
        B, S, K = q.shape[0], q.shape[1], self.head_dim
        # attention sees the sequence in its natural order (a balanced forward's is permuted)
        q, k, v = (layout.unpermute(t).view(B, S, -1, K) for t in (q, k, v))
        query_split = layout.query_split
        if query_split is None:  # no model around this block: decide here
            query_split = self.runs_query_split(B, S, q)
        if query_split:  # attention + out-proj per query slice, in the RS ring
            q, k, v = (t.transpose(0, 1) for t in rope_and_expand(q, k, v, cos_SK, sin_SK))
            balanced = layout.order == "balanced"
            return query_split_attention(q, k, v, wo.t(), self.group,
                                         order="balanced" if balanced else "contiguous",
                                         sizes=None if balanced else layout.sizes,
                                         prefetch=self.prefetch,
                                         **self.op_kwargs).transpose(0, 1)
        o_BShK = layout.permute(causal_attention(q, k, v, cos_SK, sin_SK))
        # each partial out-proj's transfer hides behind the next slice's GEMM; in backward,
        # q|k|v's re-gather is posted after its posts and hides behind the SDPA backward
        return fused_matmul_reduce_scatter(o_BShK.reshape(B, S, -1), wo.t(), "sum", 1,
                                           self.group, sizes=layout.sizes,
                                           prefetch=self.prefetch, **self.op_kwargs)

    def runs_query_split(self, batch: int, seq: int, like: torch.Tensor) -> bool:
        """``query_split``, or where it is None: under method "auto" the cost model's choice
        for ``batch`` sequences of ``seq`` tokens (`commfuse.ops.auto.choose_query_split`;
        ``like``: a tensor of the model's dtype and device), else row-parallel."""
        if self.query_split is not None:
            return self.query_split
        if self.op_kwargs.get("method") != "auto":
            return False
        T = self.group.size()
        return auto.choose_query_split(seq, batch, self.heads, self.kv_heads, self.head_dim,
                                       self.dim, T, like)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the unsharded wq/wk/wv/wo (collective over TP, and DP if sharded)."""
        out = {n: gather_rows(getattr(self, n).full_grad(), self.group) for n in ("wq", "wk", "wv")}
        out["wo"] = gather_rows(self.wo.full_grad().t().contiguous(), self.group).t()
        return out


class TPMLP(nn.Module):
    """Column-parallel gate|up (one fused AG->GEMM), SwiGLU, row-parallel down (GEMM->RS)."""

    def __init__(self, mlp: MLP, tp_group, op_kwargs: dict, dp_group=None, layout=None,
                 prefetch=None):
        super().__init__()
        self.layout, self.prefetch = layout, prefetch
        T, r = tp_group.size(), tp_group.rank()
        self.group, self.op_kwargs = tp_group, dict(op_kwargs)
        self.w_gate = weight(_rows(mlp.w_gate.weight, r, T), dp_group, op_kwargs, "w_gate", "seq")
        self.w_up = weight(_rows(mlp.w_up.weight, r, T), dp_group, op_kwargs, "w_up", "seq")
        self.w_down = weight(_cols(mlp.w_down.weight, r, T), dp_group, op_kwargs, "w_down", "seq")

    def forward(self, x_BsD):
        with regathered(self.w_gate, self.w_up, self.w_down) as (w_gate, w_up, w_down):
            return self._forward(x_BsD, w_gate, w_up, w_down)

    def _forward(self, x_BsD, w_gate, w_up, w_down):
        _, (g_BSf, u_BSf) = fused_all_gather_matmul(x_BsD, [w_gate.t(), w_up.t()], 1, self.group,
                                                    sizes=getattr(self.layout, "sizes", None),
                                                    return_A=False, prefetch=self.prefetch,
                                                    **self.op_kwargs)
        # backward: gate|up's re-gather posted after down's posts, hidden by the SwiGLU bwd
        return fused_matmul_reduce_scatter(F.silu(g_BSf) * u_BSf, w_down.t(), "sum", 1,
                                           self.group, sizes=getattr(self.layout, "sizes", None),
                                           prefetch=self.prefetch, **self.op_kwargs)

    def full_grads(self) -> dict[str, torch.Tensor]:
        out = {n: gather_rows(getattr(self, n).full_grad(), self.group) for n in ("w_gate", "w_up")}
        out["w_down"] = gather_rows(self.w_down.full_grad().t().contiguous(), self.group).t()
        return out

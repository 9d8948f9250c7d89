"""Ulysses sequence parallelism (UP) over the UP group of U ranks.

Between blocks the activations are sequence-sharded, x_BsD with s = S/U. Attention:

    [GEMM -> a2a]  y_BSc = all_to_all(x_BsD @ Wqkv^T)   my head group's q|k|v, full sequence
    attention on the full sequence for H/U heads (RoPE at each token's global position,
    since after the all-to-all the sequence is whole)
    [a2a -> GEMM]  all_to_all(o_BSh) @ wo^T             back to my sequence slice, all heads

``Wqkv`` is the replicated q|k|v weight with its rows permuted so that row block p (column
block p of Wqkv^T) holds head group p's q, k and v: the all-to-all hands rank p its own heads
(GQA: n_kv_heads divisible by U). The MLP and norms run on the local sequence shard with
replicated weights; the embedding and output head are vocabulary-parallel over the UP group
(`commfuse.parallel.vocab`). The replicated weights' gradients (each rank's contribution, per
the op contracts) are summed over it by buckets posted during the backward
(`commfuse.parallel.grad_sync`).

Shape suffixes: B batch, S sequence, s = S/U, D model, h / g = H/U / G/U heads of my group,
K head dim, c = (h + 2g) * K my group's q|k|v columns.
"""

from __future__ import annotations

import torch
from torch import nn

from commfuse.ops.fused import fused_all_to_all_matmul, fused_matmul_all_to_all
from commfuse.models.llama import Attention
from commfuse.parallel.data import regathered, weight
from commfuse.parallel.tensor import causal_attention


def permute_qkv(wq, wk, wv, groups: int) -> torch.Tensor:
    """Rows [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: head group p's q, k, v rows in block p."""
    parts = [w.unflatten(0, (groups, -1)) for w in (wq, wk, wv)]  # [U, rows/U, D] each
    return torch.cat(parts, 1).flatten(0, 1)


def unpermute_qkv(w, groups: int, q_rows: int, kv_rows: int):
    """Inverse of `permute_qkv`: (wq, wk, wv) with q_rows / kv_rows rows in total."""
    q, k, v = w.unflatten(0, (groups, -1)).split(
        [q_rows // groups, kv_rows // groups, kv_rows // groups], 1)
    return q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)


class UPAttention(nn.Module):
    """q|k|v projection fused with the all-to-all, attention, all-to-all fused with out-proj."""

    def __init__(self, attn: Attention, up_group, op_kwargs: dict, dp_group=None, layout=None):
        super().__init__()
        self.layout = layout  # the sequence split (commfuse.parallel.SeqLayout); None: even
        U = up_group.size()
        self.group, self.op_kwargs, self.head_dim = up_group, dict(op_kwargs), attn.head_dim
        self.q_rows, self.kv_rows = attn.wq.weight.shape[0], attn.wk.weight.shape[0]
        for what, rows in (("n_heads", self.q_rows), ("n_kv_heads", self.kv_rows)):
            if rows % (U * self.head_dim):
                raise ValueError(f"{what} ({rows // self.head_dim}) must be divisible by up ({U})")
        wqkv = permute_qkv(attn.wq.weight, attn.wk.weight, attn.wv.weight, U)
        self.wqkv = weight(wqkv, dp_group, op_kwargs, "wqkv")  # replicated over UP
        self.wo = weight(attn.wo.weight, dp_group, op_kwargs, "wo")

    def forward(self, x_BsD, cos_SK, sin_SK):
        # under DP the gathered weights are saved as shards, gathered again in backward
        with regathered(self.wqkv, self.wo) as (wqkv, wo):
            return self._forward(x_BsD, cos_SK, sin_SK, wqkv, wo)

    def _forward(self, x_BsD, cos_SK, sin_SK, wqkv, wo):
        U, K = self.group.size(), self.head_dim
        # block p's GEMM runs just before its send to rank p; my own block last
        y_BSc = fused_matmul_all_to_all(x_BsD, wqkv.t(), self.group, seq_dim=1,
                                        sizes=getattr(self.layout, "sizes", None),
                                        **self.op_kwargs)
        B, S = y_BSc.shape[:2]
        h, g = self.q_rows // U, self.kv_rows // U
        q, k, v = y_BSc.split([h, g, g], -1)
        o_BShK = causal_attention(q.view(B, S, -1, K), k.view(B, S, -1, K), v.view(B, S, -1, K),
                                  cos_SK, sin_SK)
        # the arriving blocks of my sequence slice are multiplied as they land; mine first
        return fused_all_to_all_matmul(o_BShK.reshape(B, S, -1), wo.t(),
                                       self.group, seq_dim=1, **self.op_kwargs)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the unsharded wq/wk/wv/wo (after sync_grads; collective over DP)."""
        wq, wk, wv = unpermute_qkv(self.wqkv.full_grad(), self.group.size(), self.q_rows,
                                   self.kv_rows)
        return {"wq": wq, "wk": wk, "wv": wv, "wo": self.wo.full_grad()}

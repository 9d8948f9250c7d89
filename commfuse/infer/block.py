"""One decoder block's weights on one rank of `commfuse.infer.InferenceLlama`, and RoPE with
a position per (sequence, token).

Shape suffixes: B batch, S tokens, H heads, G kv heads, K head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from commfuse.models.llama import window_mask


def rope(x_BSHK: torch.Tensor, cos_BSK: torch.Tensor, sin_BSK: torch.Tensor) -> torch.Tensor:
    """`commfuse.models.llama.apply_rope` with a position per (sequence, token)."""
    x1, x2 = x_BSHK.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos_BSK[:, :, None, :].to(x_BSHK.dtype), sin_BSK[:, :, None, :].to(x_BSHK.dtype)
    return x_BSHK * cos + rotated * sin


class Block(nn.Module):
    """One decoder block's weights on this rank (shards of the projections and of the q/k/v
    biases, the norms whole; q_norm / k_norm act per head, so whole too) and its sliding
    ``window`` (None: full causal attention)."""

    def __init__(self, layer, rank: int, world: int):
        super().__init__()
        rows = lambda w: w.detach()[rank * (w.shape[0] // world):(rank + 1) * (w.shape[0] // world)]
        cols = lambda w: w.detach()[:, rank * (w.shape[1] // world):
                                    (rank + 1) * (w.shape[1] // world)]
        a, m = layer.attn, layer.mlp
        self.attn_norm, self.mlp_norm = layer.attn_norm, layer.mlp_norm
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.window = a.window
        for name, w in (("wq", rows(a.wq.weight)), ("wk", rows(a.wk.weight)),
                        ("wv", rows(a.wv.weight)), ("wo", cols(a.wo.weight)),
                        ("w_gate", rows(m.w_gate.weight)), ("w_up", rows(m.w_up.weight)),
                        ("w_down", cols(m.w_down.weight))):
            self.register_buffer(name, w.contiguous().clone())
        for name, lin in (("bq", a.wq), ("bk", a.wk), ("bv", a.wv)):
            self.register_buffer(name, None if lin.bias is None else rows(lin.bias).clone())

    def qkv(self, q, k, v):
        """q, k, v of the projections' outputs: plus the biases where the model has them."""
        if self.bq is None:
            return q, k, v
        return q + self.bq, k + self.bk, v + self.bv

    def qk_heads(self, q_BSHK, k_BSGK):
        """q and k heads [.., heads, K] normed per head (Qwen3), before RoPE."""
        if self.q_norm is None:
            return q_BSHK, k_BSGK
        return self.q_norm(q_BSHK), self.k_norm(k_BSGK)

    def mask(self, q_pos, k_pos):
        """`window_mask` of this block's window; None where it is plain causal over the
        same positions (SDPA's ``is_causal``)."""
        if self.window is None and q_pos is k_pos:
            return None
        return window_mask(q_pos, k_pos, self.window)

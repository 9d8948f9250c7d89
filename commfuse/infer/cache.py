"""The KV cache of `commfuse.infer.InferenceLlama`: per layer, the keys (after RoPE) and values
of every sequence, ``k[i]``, ``v[i]`` [B, g, L, K].

A layer of full causal attention keeps every position: L = max_len, position p in slot p. A
layer whose sliding window W is shorter than max_len keeps a ring of W slots: position p in
slot p % W. A decode step at position p attends to positions p-W+1..p (transformers' window,
`commfuse.models.llama.window_mask`), which are exactly the ring's W slots once its own key
is written, so the layer's memory is W positions per sequence however long it generates.
Attention is a sum over keys, so their order in the ring does not matter; while p < W only
slots 0..p hold positions (`visible`), the later ones are empty or hold pads.

A prefill attends over the whole prompt, so it writes each layer's keys and values of every
prompt position in natural order into `prefill_kv`: the cache itself where it keeps every
position, else a scratch of S positions. `commit` then moves each ring layer's last W real
positions of each sequence (b's are l_b-W..l_b-1, never its pads) into their slots.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of ``n_layers`` layers for ``batch`` sequences of up to ``max_len``
    positions; ``windows``: each layer's sliding window (None: full attention), a ring of W
    slots where W < max_len (module doc).

    ``lengths_B``: positions filled per sequence (the next token of sequence b goes at
    position ``lengths_B[b]``); slots past it are stale or empty and masked."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device=None, windows=None):
        windows = list(windows) if windows is not None else [None] * n_layers
        self.ring = [w if w is not None and w < max_len else None for w in windows]
        """Per layer: its ring's W slots, or None where it keeps every position."""
        shapes = [(batch, kv_heads, w or max_len, head_dim) for w in self.ring]
        self.k = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.v = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.lengths_B = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prefill_kv(self, i: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values [B, g, S, K] of a prefill of S positions, in natural
        order, for the prefill to write and read (`commit` when it is done)."""
        if self.ring[i] is None:
            return self.k[i][:, :, :S], self.v[i][:, :, :S]
        if i not in self._scratch:
            B, g, _, K = self.k[i].shape
            self._scratch[i] = (self.k[i].new_zeros(B, g, S, K), self.v[i].new_zeros(B, g, S, K))
        return self._scratch[i]

    def commit(self, lengths_B: torch.Tensor) -> None:
        """The prefill of prompts of ``lengths_B`` tokens done: each ring layer's slot s takes
        the last real position p of its sequence with p % W == s (`visible` hides the slots
        with none), and the lengths are set."""
        for i, (k, v) in self._scratch.items():
            W = self.ring[i]
            last_B1 = lengths_B[:, None].to(k.device) - 1
            src_BW = (last_B1 - (last_B1 - torch.arange(W, device=k.device)) % W).clamp(min=0)
            idx = src_BW[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.k[i].copy_(k.gather(2, idx))
            self.v[i].copy_(v.gather(2, idx))
        self._scratch.clear()
        self.lengths_B.copy_(lengths_B)

    def slots(self, i: int, pos_B: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s slot of each sequence's position ``pos_B``."""
        return pos_B % self.ring[i] if self.ring[i] is not None else pos_B

    def keys(self, i: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values a decode step reads, positions below ``L`` (every
        slot of a ring)."""
        if self.ring[i] is not None:
            return self.k[i], self.v[i]
        return self.k[i][:, :, :L], self.v[i][:, :, :L]

    def visible(self, i: int, pos_B: torch.Tensor) -> torch.Tensor | None:
        """[B, W] which of ring layer ``i``'s slots a decode step at ``pos_B`` (its key
        written) attends to: slots up to the position, every slot from W - 1 on; None for
        a layer that keeps every position (its window mask applies)."""
        W = self.ring[i]
        if W is None:
            return None
        return torch.arange(W, device=pos_B.device) <= pos_B[:, None]

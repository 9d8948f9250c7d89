"""How the current forward's sequence is split over the seq (TP or UP) ranks."""

from __future__ import annotations

import torch

from commfuse.ops.binding import even_sizes
from commfuse.schedule import balanced_split


class SeqLayout:
    """How the current forward's sequence is split over the seq ranks, and in which order.

    ``order="contiguous"``: rank p holds rows ``sum(sizes[:p])..`` of the sequence, `even_sizes`
    of its length (any length: 10 tokens over 4 ranks = 3, 3, 2, 2). ``order="balanced"``
    (TP with query-split attention): the model runs on the sequence permuted so that rank p's
    contiguous shard is chunk p and chunk 2W-1-p of 2W (`balanced_split`), the order in which
    query-split's ring steps cost the same under a causal mask. Every op between the blocks
    is position-wise, so only attention (`positions` / `inverse`) and the loss's targets see
    the permutation. The model (`commfuse.parallel.plan.ParallelLlama`) sets the order and
    ``query_split`` per forward (`begin`); the vocabulary-parallel embedding records the split
    (`shard`); the TP/UP blocks and the head pass it to the fused ops that take a shard."""

    def __init__(self, index: int, world: int):
        self.index, self.world = index, world
        self.sizes: tuple[int, ...] | None = None
        self.order = "contiguous"
        self.query_split: bool | None = None  # None: each TP attention decides (no model)
        self.positions: torch.Tensor | None = None  # balanced: position of each row, in order
        self.inverse: torch.Tensor | None = None  # balanced: row of each position

    def begin(self, seq_len: int, query_split: bool | None, device=None) -> None:
        """This forward's sequence: its order is balanced iff query-split runs on > 1 rank."""
        self.query_split = query_split
        self.order = "balanced" if query_split and self.world > 1 else "contiguous"
        self.positions = self.inverse = None
        if self.order == "balanced":
            self.positions = torch.tensor(balanced_split(seq_len, self.world)[1], device=device)
            self.inverse = torch.empty_like(self.positions)
            self.inverse[self.positions] = torch.arange(seq_len, device=device)

    def permute(self, t_BS: torch.Tensor) -> torch.Tensor:
        """``t_BS`` ([B, S, ...], natural order) in this forward's order."""
        return t_BS if self.positions is None else t_BS.index_select(1, self.positions)

    def unpermute(self, t_BS: torch.Tensor) -> torch.Tensor:
        """``t_BS`` ([B, S, ...], this forward's order) in the natural order."""
        return t_BS if self.inverse is None else t_BS.index_select(1, self.inverse)

    def natural_heads(self, t_BSHd: torch.Tensor) -> torch.Tensor:
        """``t_BSHd`` (this forward's order) as [S, B, H, d] in the natural order, a view of a
        contiguous [B, H, S, d] tensor: the layout query-split attention reads, made in one
        copy (its own would be a second)."""
        t_BHSd = t_BSHd.permute(0, 2, 1, 3)
        t_BHSd = t_BHSd.contiguous() if self.inverse is None else \
            t_BHSd.index_select(2, self.inverse)
        return t_BHSd.permute(2, 0, 1, 3)

    def split(self, seq_len: int) -> tuple[int, ...]:
        """Rows per rank of a sequence of ``seq_len`` in this order."""
        if self.order == "balanced":
            return balanced_split(seq_len, self.world)[0]
        return even_sizes(seq_len, self.world)

    def shard(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This rank's part of dim 1 of ``t_BS`` (already in this forward's order), and
        remember the split."""
        self.sizes = self.split(t_BS.shape[1])
        start = sum(self.sizes[:self.index])
        return t_BS[:, start:start + self.sizes[self.index]]

"""How the current forward's sequence is split over the seq (TP or UP) ranks."""

from __future__ import annotations

import torch

from commfuse.ops.binding import even_sizes


class SeqLayout:
    """How the current forward's sequence is split over the seq ranks: `even_sizes` of its
    length (any length: 10 tokens over 4 ranks = 3, 3, 2, 2). The vocabulary-parallel
    embedding sets it from the tokens; the TP/UP blocks and the head pass it to the fused ops
    that take a shard."""

    def __init__(self, index: int, world: int):
        self.index, self.world = index, world
        self.sizes: tuple[int, ...] | None = None

    def shard(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This rank's part of dim 1 of ``t_BS`` (and remember the split)."""
        self.sizes = even_sizes(t_BS.shape[1], self.world)
        start = sum(self.sizes[:self.index])
        return t_BS[:, start:start + self.sizes[self.index]]

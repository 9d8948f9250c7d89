"""What a whole-model plan (`commfuse.tp.parallelize`'s derived plan) shares across its
modules: one set of styles built from the method and its options."""

from __future__ import annotations

from typing import NamedTuple

from commfuse.ops.prefetch import Prefetcher
from commfuse.tp.sequence import SeqSplit, SequenceParallelNorm
from commfuse.tp.style import FusedColwiseParallel, FusedRowwiseParallel


class PlanStyles(NamedTuple):
    """The styles a whole-model plan (`commfuse.tp.parallelize`'s) shares: one sequence
    split and one prefetch chain for every layer, the op options ``kw`` (``ag``: with
    ``save_gathered``, for the all-gather -> GEMM styles), and the column, row and norm
    styles built from them."""

    split: SeqSplit
    chain: Prefetcher
    kw: dict
    ag: dict
    col: FusedColwiseParallel
    row: FusedRowwiseParallel
    norm: SequenceParallelNorm


def plan_styles(method: str, save_gathered: bool, prefetch: bool, opts: dict) -> PlanStyles:
    """`PlanStyles` for ``method`` and its ``opts``; ``prefetch``: the row styles post the
    next layer's all-gather early (a chain of depth 1)."""
    split, chain = SeqSplit(), Prefetcher(1 if prefetch else 0)
    kw = dict(method=method, split=split, **opts)
    ag = dict(kw, save_gathered=save_gathered)
    return PlanStyles(split, chain, kw, ag, FusedColwiseParallel(**ag),
                      FusedRowwiseParallel(prefetch=chain, **kw), SequenceParallelNorm())

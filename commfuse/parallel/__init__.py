"""Parallelism applied to the plain `commfuse.models.llama.Llama` by a plan, not by editing it.

    config.py      `ParallelDims` (validated, importable without torch) and its `Mesh` of groups
    layout.py      how the sequence is split over the TP/UP ranks (`SeqLayout`)
    tensor.py      TPSP: column/row-parallel attention and MLP over the fused AG/RS ops
    ulysses.py     Ulysses: attention between the fused GEMM<->all-to-all ops
    data.py        ZeRO-3 DP: weight rows gathered inside the forward GEMM
    plan.py        `parallelize` and the `ParallelLlama` wrapper (loss, gradient sync)
    checkpoint.py  DCP save/load of every rank's shards

Exports resolve lazily (PEP 562), so `commfuse.parallel.config` imports without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParallelDims": "commfuse.parallel.config",
    "Mesh": "commfuse.parallel.config",
    "mark_sharded": "commfuse.parallel.config",
    "sharded_axes": "commfuse.parallel.config",
    "SeqLayout": "commfuse.parallel.layout",
    "ParallelLlama": "commfuse.parallel.plan",
    "parallelize": "commfuse.parallel.plan",
    "save_checkpoint": "commfuse.parallel.checkpoint",
    "load_checkpoint": "commfuse.parallel.checkpoint",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'commfuse.parallel' has no attribute {name!r}")

"""Parallelism applied to the plain `commfuse.models.llama.Llama` by a plan, not by editing it.

    config.py      `ParallelDims` (validated, importable without torch) and its `Mesh` of groups
    layout.py      how the sequence is split over the TP/UP ranks (`SeqLayout`)
    tensor.py      TPSP: column/row-parallel attention and MLP over the fused AG/RS ops
    ulysses.py     Ulysses: attention between the fused GEMM<->all-to-all ops
    data.py        ZeRO-3 DP: weight rows gathered inside the forward GEMM
    vocab.py       vocabulary-parallel embedding, output head and cross-entropy (TP/UP)
    grad_sync.py   replicated parameters' gradients, bucketed, all-reduced during the backward
    plan.py        `parallelize` and the `ParallelLlama` wrapper (loss, gradient sync)
    checkpoint.py  DCP save/load of every rank's shards

Exports resolve lazily (PEP 562), so `commfuse.parallel.config` imports without torch.
"""

from __future__ import annotations

from commfuse import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.parallel.config": ("ParallelDims", "Mesh", "mark_sharded", "sharded_axes"),
    "commfuse.parallel.layout": ("SeqLayout",),
    "commfuse.parallel.plan": ("ParallelLlama", "parallelize"),
    "commfuse.parallel.checkpoint": ("save_checkpoint", "load_checkpoint"),
})

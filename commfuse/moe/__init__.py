"""Mixture-of-Experts: the layer (plain PyTorch) and its expert parallelism.

    config.py     MoEConfig and presets (pure)
    layer.py      the reference layer: top-k router, SwiGLU experts, weighted sum
    parallel.py   ExpertParallelMoE: experts sharded over a process group, tokens moved by
                  the fused dispatch/combine ops (`commfuse.ops.moe`); expert_ffn, its
                  routed-token core, which `commfuse.tp.experts` runs in transformers' MoE blocks

Exports resolve lazily (PEP 562): `commfuse.moe.config` imports without torch.
"""

from __future__ import annotations

from commfuse import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.moe.config": ("MoEConfig", "PRESETS"),
    "commfuse.moe.layer": ("MoELayer", "route", "swiglu"),
    "commfuse.moe.parallel": ("ExpertParallelMoE", "expert_ffn"),
})

"""Tensor + sequence parallelism (TPSP) for your own model on a DeviceMesh, with every
all-gather / reduce-scatter fused with its GEMM by commfuse.

    functional.py  the autograd pieces: shard_seq, gather_cols, sum_grad
    style.py       ParallelStyles for torch's parallelize_module: FusedColwiseParallel,
                   FusedRowwiseParallel, FusedProjections, SequenceParallelNorm,
                   ReplicateParallel, ShardSequence, and the shared SeqSplit
    hf.py          parallelize(model, mesh): the plan for transformers' Llama/Mistral/Qwen2/Qwen3
    mesh.py        tp_mesh: the "tp" dim of a user's mesh
    plan_styles.py the styles every whole-model plan shares (plan_styles)
    loss.py        loss_parallel=True: vocabulary-sharded logits and their cross-entropy
    mamba.py       MambaMixerParallel: a Mamba-2 mixer's TPSP (MixerLayout: its rows per rank)
    hf_mamba.py    parallelize_mamba: the plans for transformers' Mamba2ForCausalLM,
                   BambaForCausalLM and NemotronHForCausalLM (parallelize dispatches to it)
    experts.py     ExpertParallel: a sparse MoE block's experts split over the mesh
    hf_moe.py      parallelize_moe: MixtralForCausalLM and Qwen3MoeForCausalLM, experts split
                   over the TP ranks (parallelize dispatches to it)

Exports resolve lazily (PEP 562).
"""

from __future__ import annotations

from commfuse import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.tp.style": ("FusedColwiseParallel", "FusedRowwiseParallel", "FusedProjections",
                          "SequenceParallelNorm", "ReplicateParallel", "ShardSequence",
                          "SeqSplit"),
    "commfuse.tp.hf": ("parallelize",),
    "commfuse.tp.mesh": ("tp_mesh",),
    "commfuse.tp.mamba": ("MambaMixerParallel", "MixerLayout"),
    "commfuse.tp.hf_mamba": ("parallelize_mamba",),
    "commfuse.tp.hf_moe": ("parallelize_moe",),
    "commfuse.tp.experts": ("ExpertParallel",),
})

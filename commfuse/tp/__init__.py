"""Tensor + sequence parallelism (TPSP) for your own model on a DeviceMesh, with every
all-gather / reduce-scatter fused with its GEMM by commfuse.

    functional.py  the autograd pieces: shard_seq, gather_cols, sum_grad, sum_grad_later
    style.py       ParallelStyles for torch's parallelize_module: FusedColwiseParallel,
                   FusedRowwiseParallel, FusedProjections; PlanStyles, what a plan shares
    sequence.py    the styles without a GEMM: SequenceParallelNorm, ReplicateParallel,
                   ShardSequence, and the shared SeqSplit
    plan.py        parallelize(model, mesh): the plan derived from a transformers causal LM's
                   base_model_tp_plan and module types (derive_plan), refusing what it
                   does not cover
    derive.py      derive_plan: the plan read from the model (families.py: the tested ones)
    mesh.py        tp_mesh: the "tp" dim of a user's mesh
    attention.py   this rank's heads: local_heads, packed q|k|v and gate|up rows
    norms.py       SplitDimNorm: an RMSNorm over a TP-split dim (OLMo 2's q/k norm)
    embedding.py   VocabParallelEmbedding: a tied embedding sharing the head's vocabulary rows
    loss.py        loss_parallel=True: vocabulary-sharded logits and their cross-entropy
    experts.py     ExpertParallel: a sparse MoE block's experts split over the mesh
    balance.py     expert load, DeepSeek-V3's bias update, capacity (ExpertLoad)
    router_loss.py RouterLosses: the sequence-level aux loss and the router z-loss
    mixers/        the mixers planned whole: Mamba-2, Gated DeltaNet, latent attention

Exports resolve lazily (PEP 562).
"""

from __future__ import annotations

from commfuse import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.tp.style": ("FusedColwiseParallel", "FusedRowwiseParallel", "FusedProjections"),
    "commfuse.tp.sequence": ("SequenceParallelNorm", "ReplicateParallel", "ShardSequence",
                             "SeqSplit"),
    "commfuse.tp.plan": ("parallelize", "derive_plan"),
    "commfuse.tp.mesh": ("tp_mesh",),
    "commfuse.tp.mixers.mamba": ("MambaMixerParallel", "MixerLayout"),
    "commfuse.tp.embedding": ("VocabParallelEmbedding",),
    "commfuse.tp.norms": ("SplitDimNorm",),
    "commfuse.tp.experts": ("ExpertParallel",),
})

"""`parallelize`: commfuse TPSP on a transformers causal LM, the plan derived from the model.

The plan comes from the model's own description of how it splits, its config's
``base_model_tp_plan`` (``"layers.*.self_attn.q_proj": "colwise"``, ``"rowwise"``, ...),
completed from its module types where that table is partial or absent, and every module
with parameters must be covered, or `parallelize` refuses the model before a weight moves.
Every rank passes the same full ``input_ids``; between the layers the hidden states are
sequence-sharded (``[B, s, D]``). What each module becomes, on T ranks:

    colwise nn.Linear       FusedColwiseParallel: AG->GEMM; those with one parent (q|k|v,
                            gate|up) share one fused all-gather (FusedProjections on the
                            parent); k/v with replicas=T/G when G < T; packed q|k|v and
                            gate|up (`PACKED`) hold whole heads / matching gate and up rows
    rowwise nn.Linear       FusedRowwiseParallel: GEMM->RS, its bias added once
    a norm on the residual  SequenceParallelNorm (a direct child of a layer or of the base
                            model: sandwich, post- and final norms alike)
    a per-head norm         SequenceParallelNorm on this rank's heads (width head_dim)
    scalar parameters       SequenceParallelNorm (an activation's: per element)
    a norm over a split dim SplitDimNorm (width of its projection: OLMo 2's q/k norm)
    a sparse MoE block      ExpertParallel: its experts split over the same ranks
    a Gated DeltaNet mixer  DeltaNetParallel: its in_proj linears one AG->GEMM onto this
                            rank's heads, conv / delta rule / gated norm local, out_proj
                            row-parallel (`commfuse.tp.mixers.deltanet`)
    a latent attention      MLAParallel (`commfuse.tp.mixers.mla`): latents on the sequence shard,
                            gathered into the heads' up-projections; o_proj GEMM->RS
    a Mamba-2 mixer         MambaMixerParallel: in_proj one AG->GEMM onto this rank's SSM
                            heads and their B/C groups, conv / scan / gated norm local,
                            out_proj row-parallel (`commfuse.tp.mixers.mamba`)
    the embedding           ReplicateParallel; tied to the head: VocabParallelEmbedding
    lm_head                 FusedColwiseParallel over the vocabulary (gathered, or kept
                            sharded with ``loss_parallel``)
    layers.0                ShardSequence: its input sliced (tied: reduce-scattered)

Attention modules learn their local head counts (`commfuse.tp.attention.local_heads`).
Hybrids need nothing of their own: a layer's modules are planned by what they are, whatever
the layer holds (Mamba-2 beside attention in one block, a mixer named ``mixer`` that is an
attention in one layer and an MLP in the next).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from commfuse.runtime.gloo import duplex
from commfuse.tp.attention import local_heads
from commfuse.tp.derive import Plan, base_model, derive_plan
from commfuse.tp.embedding import tie
from commfuse.tp.experts import ExpertParallel, router_logits_index
from commfuse.tp.loss import install_loss_parallel
from commfuse.tp.mesh import ep_mesh, tp_mesh
from commfuse.tp.style import plan_styles
from commfuse.tp.sequence import HeadParameters, gather_final

__all__ = ["Plan", "base_model", "derive_plan", "parallelize"]


def parallelize(model: nn.Module, mesh: DeviceMesh, *, method: str = "auto",
                save_gathered: bool = False, prefetch: bool = True, loss_parallel: bool = False,
                ep: int | None = None, capacity_factor: float | None = None,
                defer_grad_sums: bool = False, **opts) -> nn.Module:
    """Shard ``model`` (a transformers causal LM, the same on every rank) for commfuse TPSP
    over ``mesh`` (1-D, or the "tp" dim of a larger one), in place; returns it.

    ``method`` and ``opts`` go to every fused op (`commfuse.fused_all_gather_matmul`, and the
    MoE ops of sparse blocks). After it, ``model(input_ids, labels=...)`` gives every rank
    the unsharded model's logits and loss, and each parameter's ``.grad`` is its shard of
    the unsharded gradient (replicated ones summed over TP during the backward), so any
    optimizer steps it. Parameters are DTensors. ``config.use_cache`` is set False for
    training; transformers' ``model.generate`` works (it passes ``use_cache``): prefill on
    the fused, sequence-sharded path, each decode step (fewer tokens than ranks, no
    gradients) on a replicated one whose row-parallel linears close with an all-reduce; the
    caches hold this rank's heads. A forward without gradients gathers the last hidden
    states over the sequence before the head (`commfuse.tp.sequence.gather_final`), so
    ``logits_to_keep`` slices whole sequences.
    ``save_gathered=True``: the column-parallel projections keep their gathered input for
    backward, as DTensor's tensor parallelism does (more activation memory, one all-gather per
    projection fewer in backward); by default they keep only the sequence shard.
    ``prefetch``: each row-parallel backward posts the re-gather of the fused projections
    before it ahead, so it moves during the attention / MLP backward (`commfuse.ops.prefetch`).
    ``ep``: the ranks each sparse MoE block's experts are split over (default: the TP
    group); more than the TP size draws them from the data-parallel ranks (``mesh`` covers
    every rank, "tp" last; `commfuse.tp.mesh.ep_mesh`): each rank dispatches its own tokens
    to the group's experts, and the expert gradients come out as the data-parallel mean, so
    data parallelism over the other weights leaves them out
    (`commfuse.tp.experts.expert_parameters`).
    ``capacity_factor`` (None: dropless): each sparse block's experts take at most
    ceil(N k / E * factor) rows of a rank's N tokens, those of the highest routing weight,
    the rest dropped (Megatron's capacity and "probs" policy: `commfuse.moe.capacity`).
    ``defer_grad_sums=True``: the replicated parameters' gradient sums (norms, latent
    projections) are posted where the backward reaches them and added into ``.grad`` when
    it ends, so they travel behind the backward's compute; for a loop that reads ``.grad``
    only after ``backward()`` (not under DDP, nor with ``torch.autograd.grad``:
    `commfuse.tp.functional.sum_grad_later`).
    ``loss_parallel=True``: the output head keeps this rank's vocabulary columns (``logits``
    is ``[B, S, V/T]``) and ``model.loss_function`` becomes the vocabulary-parallel
    cross-entropy (`commfuse.tp.loss`), so ``model(..., labels=...).loss`` is the unsharded
    loss without the ``[B, S, V]`` logits moving.
    A model the plan does not cover is refused (ValueError) before any weight moves.
    """
    emesh = ep_mesh(mesh, ep) if ep not in (None, tp_mesh(mesh).size()) else None
    mesh = tp_mesh(mesh)
    T = mesh.size()
    ps = plan_styles(method, save_gathered, prefetch, opts, defer_grad_sums)
    moe = ExpertParallel(split=ps.split, method=method, logits_index=router_logits_index(model),
                         ep_mesh=emesh, capacity_factor=capacity_factor, **opts)
    plan = derive_plan(model, T, ps, loss_parallel, moe)
    duplex(mesh.get_group())
    for attn in plan.attention:
        local_heads(attn, model.config, T)
    model.config.use_cache = False
    parallelize_module(model, mesh, plan.styles)
    for name in plan.head_params:
        parallelize_module(model.get_submodule(name), mesh, HeadParameters())
    gather_final(base_model(model)[1], ps.split, mesh.get_group())
    if plan.tied:
        tie(model.get_input_embeddings(), model.lm_head)
    if loss_parallel:
        install_loss_parallel(model, mesh.get_group())
    return model

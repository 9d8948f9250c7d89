"""`parallelize_mamba`: commfuse TPSP on transformers' Mamba-2 and hybrid Mamba-2/attention
causal LMs, in place (`commfuse.tp.parallelize` dispatches here for the names in ``KNOWN``).

The same contract as `commfuse.tp.parallelize` (every rank passes the full ``input_ids``,
sequence-sharded hidden states between the layers, full logits and loss on every rank, each
``.grad`` this rank's shard of the unsharded gradient). The plans, on T ranks:

    Mamba2ForCausalLM
      backbone.embeddings           ReplicateParallel
      backbone.layers.0             ShardSequence
      *.norm, backbone.norm_f       SequenceParallelNorm
      *.mixer                       MambaMixerParallel: in_proj AG->GEMM, conv/scan/norm local
      *.mixer.out_proj              FusedRowwiseParallel: GEMM->RS
      lm_head                       FusedColwiseParallel(gather_output=True)
    BambaForCausalLM (Mamba-2 layers and attention layers, each with a SwiGLU MLP)
      model.embed_tokens, model.layers.0, model.final_layernorm, lm_head   as above
      *.input_layernorm, *.pre_ff_layernorm                                SequenceParallelNorm
      *.mamba, *.mamba.out_proj                                            as *.mixer above
      *.self_attn: FusedProjections(q, k, v) (k/v replicated when kv heads < T), o_proj row
      *.feed_forward: FusedProjections(gate, up), down_proj row

Mixer parameters are DTensors; in_proj and conv1d are shards of the assembled weight
(`commfuse.tp.mamba`). Sets ``config.use_cache = False``: no generation cache under TP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from commfuse.ops.prefetch import Prefetcher
from commfuse.runtime.gloo import duplex
from commfuse.tp.mamba import MambaMixerParallel, MixerLayout, mixer_layout
from commfuse.tp.mesh import tp_mesh
from commfuse.tp.style import (FusedColwiseParallel, FusedProjections, FusedRowwiseParallel,
                               ReplicateParallel, SeqSplit, SequenceParallelNorm, ShardSequence)

# class name -> (embedding, layers, final norm): the module names its plan uses
KNOWN = {"Mamba2ForCausalLM": ("backbone.embeddings", "backbone.layers", "backbone.norm_f"),
         "BambaForCausalLM": ("model.embed_tokens", "model.layers", "model.final_layernorm")}
LAYER = {"Mamba2ForCausalLM": ("norm", "mixer"),
         "BambaForCausalLM": ("input_layernorm", "pre_ff_layernorm", "feed_forward.gate_proj",
                              "feed_forward.up_proj", "feed_forward.down_proj")}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _missing(model: nn.Module, name: str) -> list[str]:
    have = dict(model.named_modules())
    emb, layers, final = KNOWN[name]
    missing = [n for n in (emb, layers, final, "lm_head") if n not in have]
    if missing:
        return missing
    if not isinstance(have[layers], nn.ModuleList) or not len(have[layers]):
        return [f"{layers} (a non-empty ModuleList)"]
    for i, layer in enumerate(have[layers]):
        p = f"{layers}.{i}."
        missing += [p + n for n in LAYER[name] if p + n not in have]
        if name == "BambaForCausalLM":
            kinds = [n for n in ("mamba", "self_attn") if p + n in have]
            if len(kinds) != 1:
                missing.append(p + "mamba or " + p + "self_attn (exactly one)")
            elif kinds == ["self_attn"]:
                missing += [p + "self_attn." + n for n in ATTN if p + "self_attn." + n not in have]
    return missing


def check(model: nn.Module, T: int) -> dict[str, MixerLayout]:
    """Raise if ``model`` cannot run on ``T`` TP ranks (a ValueError naming what is missing
    or what does not divide); return its mixers' layouts by module name."""
    name = type(model).__name__
    missing = _missing(model, name) if name in KNOWN else ["a known class"]
    if missing:
        raise ValueError(f"commfuse.tp.parallelize does not know {name} as a Mamba-2 model "
                         f"({', '.join(KNOWN)}); missing: {', '.join(missing)}")
    emb, layers, _ = KNOWN[name]
    if model.lm_head.weight is model.get_submodule(emb).weight:
        raise ValueError("tied input/output embeddings are not supported by commfuse.tp "
                         "(the head is vocab-sharded, the embedding replicated): untie them")
    if model.lm_head.out_features < T:
        raise ValueError(f"vocab size ({model.lm_head.out_features}) is below the TP size ({T})")
    mixers = {n: m for n, m in model.named_modules()
              if n.startswith(layers + ".") and n.rsplit(".", 1)[1] in ("mixer", "mamba")}
    if any(n.endswith(".self_attn") for n, _ in model.named_modules()):
        H, G = model.config.num_attention_heads, model.config.num_key_value_heads
        if H % T:
            raise ValueError(f"num_attention_heads ({H}) must be divisible by the TP size ({T})")
        if G % T and T % G:
            raise ValueError(f"num_key_value_heads ({G}) and the TP size ({T}) must divide one "
                             f"another (kv heads are split, or replicated when fewer than ranks)")
    return {n: mixer_layout(m, T, n) for n, m in mixers.items()}


def parallelize_mamba(model: nn.Module, mesh: DeviceMesh, *, method: str = "auto",
                      save_gathered: bool = False, prefetch: bool = True, **opts) -> nn.Module:
    """Shard ``model`` (one of ``KNOWN``, the same on every rank) for commfuse TPSP over
    ``mesh`` (1-D, or its "tp" dim), in place; returns it. Arguments as
    `commfuse.tp.parallelize`."""
    mesh = tp_mesh(mesh)
    T = mesh.size()
    check(model, T)
    duplex(mesh.get_group())
    split, chain = SeqSplit(), Prefetcher(1 if prefetch else 0)
    kw = dict(method=method, split=split, **opts)
    ag = dict(kw, save_gathered=save_gathered)
    col, row, norm = FusedColwiseParallel(**ag), FusedRowwiseParallel(prefetch=chain, **kw), \
        SequenceParallelNorm()
    mixer = MambaMixerParallel(prefetch=chain, **ag)
    name = type(model).__name__
    emb, layers, final = KNOWN[name]
    plan = {emb: ReplicateParallel(), f"{layers}.0": ShardSequence(split, prefetch=chain),
            final: norm, "lm_head": FusedColwiseParallel(gather_output=True, **ag)}
    for i, layer in enumerate(model.get_submodule(layers)):
        p = f"{layers}.{i}."
        if name == "Mamba2ForCausalLM":
            plan.update({p + "norm": norm, p + "mixer": mixer, p + "mixer.out_proj": row})
            continue
        plan.update({p + "input_layernorm": norm, p + "pre_ff_layernorm": norm,
                     p + "feed_forward": FusedProjections(("gate_proj", "up_proj"),
                                                          prefetch=chain, **ag),
                     p + "feed_forward.gate_proj": col, p + "feed_forward.up_proj": col,
                     p + "feed_forward.down_proj": row})
        if hasattr(layer, "mamba"):
            plan.update({p + "mamba": mixer, p + "mamba.out_proj": row})
        else:
            plan.update(_attention(layer.self_attn, p + "self_attn", model.config, T, chain, ag,
                                   col, row))
    model.config.use_cache = False
    parallelize_module(model, mesh, plan)
    return model


def _attention(attn: nn.Module, name: str, cfg, T: int, chain, ag, col, row) -> dict:
    """The Llama-style attention plan (as `commfuse.tp.hf`): one fused q|k|v AG->GEMM, kv
    heads replicated when fewer than ranks, o_proj GEMM->RS; sets the local head counts."""
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    kv = FusedColwiseParallel(replicas=T // G if G < T else 1, **ag)
    attn.num_key_value_groups = (H // T) // max(G // T, 1)
    return {name: FusedProjections(("q_proj", "k_proj", "v_proj"), prefetch=chain, **ag),
            name + ".q_proj": col, name + ".k_proj": kv, name + ".v_proj": kv,
            name + ".o_proj": row}

"""`parallelize`: commfuse TPSP on a Hugging Face transformers causal LM, in place.

Known: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM (any model with
their module names); Mamba2ForCausalLM, BambaForCausalLM and NemotronHForCausalLM go to
`commfuse.tp.hf_mamba.parallelize_mamba`; MixtralForCausalLM and Qwen3MoeForCausalLM (experts
split over the TP ranks) to `commfuse.tp.hf_moe.parallelize_moe`. Every rank passes the same full ``input_ids``; between the layers the hidden states are
sequence-sharded (``[B, s, D]``). The plan, on the TP mesh of T ranks:

    model.embed_tokens           ReplicateParallel: the full sequence on every rank
    model.layers.0               ShardSequence: its input sliced to this rank's shard
    *.input_layernorm, *.post_attention_layernorm, model.norm, *.q_norm, *.k_norm
                                 SequenceParallelNorm (gradients summed over TP)
    *.self_attn                  FusedProjections(q_proj, k_proj, v_proj): one fused AG->GEMM
    *.self_attn.{q,k,v}_proj     FusedColwiseParallel (k/v with replicas=T/G when G < T)
    *.self_attn.o_proj           FusedRowwiseParallel: GEMM->RS
    *.mlp                        FusedProjections(gate_proj, up_proj)
    *.mlp.{gate,up}_proj, down_proj   FusedColwiseParallel, FusedRowwiseParallel
    lm_head                      FusedColwiseParallel(gather_output=True): full logits everywhere
                                 (loss_parallel=True: this rank's vocabulary columns, and a
                                 vocabulary-parallel loss_function; `commfuse.tp.loss`)

Each attention then runs on the full sequence of H/T query heads and max(G/T, 1) kv heads.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from commfuse.runtime.gloo import duplex
from commfuse.tp.hf_mamba import KNOWN as MAMBA, parallelize_mamba
from commfuse.tp.hf_moe import KNOWN as MOE, parallelize_moe
from commfuse.tp.loss import head_style, install_loss_parallel
from commfuse.tp.mesh import tp_mesh
from commfuse.tp.plan_styles import plan_styles
from commfuse.tp.style import (FusedColwiseParallel, FusedProjections, ReplicateParallel,
                               ShardSequence)

KNOWN = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
         "post_attention_layernorm")
CONFIG = ("num_attention_heads", "num_key_value_heads", "hidden_size")


def _missing(model: nn.Module) -> list[str]:
    """What a Llama-style causal LM has that ``model`` lacks (empty when it fits)."""
    have = dict(model.named_modules())
    missing = [n for n in ("model.embed_tokens", "model.layers", "model.norm", "lm_head")
               if n not in have]
    if "model.layers" in have:
        layers = have["model.layers"]
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            return missing + ["model.layers (a non-empty ModuleList)"]
        missing += [f"model.layers.0.{n}" for n in LAYER if f"model.layers.0.{n}" not in have]
        missing += [f"model.layers.0.{n} (nn.Linear)" for n in LAYER[:7]
                    if f"model.layers.0.{n}" in have
                    and not isinstance(have[f"model.layers.0.{n}"], nn.Linear)]
    cfg = getattr(model, "config", None)
    missing += [f"config.{n}" for n in CONFIG if not isinstance(getattr(cfg, n, None), int)]
    return missing


def check(model: nn.Module, T: int) -> int:
    """Raise if ``model`` cannot run on ``T`` TP ranks; return the kv-head replication k."""
    missing = _missing(model)
    if missing:
        raise ValueError(f"commfuse.tp.parallelize does not know {type(model).__name__}: it "
                         f"takes a Llama-style causal LM ({', '.join(KNOWN)}); missing: "
                         f"{', '.join(missing)}")
    cfg = model.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    if H % T:
        raise ValueError(f"num_attention_heads ({H}) must be divisible by the TP size ({T})")
    if G % T and T % G:
        raise ValueError(f"num_key_value_heads ({G}) and the TP size ({T}) must divide one "
                         f"another (kv heads are split, or replicated when fewer than ranks)")
    if model.lm_head.weight is model.model.embed_tokens.weight:
        raise ValueError("tied input/output embeddings are not supported by commfuse.tp "
                         "(the head is vocab-sharded, the embedding replicated): untie them")
    if model.lm_head.out_features < T:
        raise ValueError(f"vocab size ({model.lm_head.out_features}) is below the TP size ({T})")
    return T // G if G < T else 1


def parallelize(model: nn.Module, mesh: DeviceMesh, *, method: str = "auto",
                save_gathered: bool = False, prefetch: bool = True, loss_parallel: bool = False,
                **opts) -> nn.Module:
    """Shard ``model`` (a transformers Llama-style causal LM, the same on every rank) for
    commfuse TPSP over ``mesh`` (1-D, or the "tp" dim of a larger one), in place; returns it.

    ``method`` and ``opts`` go to every fused op (`commfuse.fused_all_gather_matmul`). After it,
    ``model(input_ids, labels=...)`` gives every rank the unsharded model's logits and loss,
    and each parameter's ``.grad`` is its shard of the unsharded gradient (replicated ones
    summed over TP during the backward), so any optimizer steps it. Parameters are DTensors.
    Training/scoring forward only: no KV-cache generation, no ``logits_to_keep``.
    ``save_gathered=True``: the column-parallel projections keep their gathered input for
    backward, as DTensor's tensor parallelism does (more activation memory, one all-gather per
    projection fewer in backward); by default they keep only the sequence shard.
    ``prefetch``: each o_proj / down_proj backward posts the re-gather of the fused
    projections before it ahead, so it moves during the attention / MLP backward
    (`commfuse.ops.prefetch`; False: each gathers in its own backward; nothing to prefetch
    with ``save_gathered``).
    ``loss_parallel=True``: the output head keeps this rank's vocabulary columns (``logits``
    is ``[B, S, V/T]``, not all-gathered) and ``model.loss_function`` becomes the
    vocabulary-parallel cross-entropy (`commfuse.tp.loss`), so ``model(..., labels=...).loss``
    is the unsharded loss (up to float rounding) without the ``[B, S, V]`` logits moving.
    """
    if type(model).__name__ in MAMBA:
        return parallelize_mamba(model, mesh, method=method, save_gathered=save_gathered,
                                 prefetch=prefetch, loss_parallel=loss_parallel, **opts)
    if type(model).__name__ in MOE:
        return parallelize_moe(model, mesh, method=method, save_gathered=save_gathered,
                               prefetch=prefetch, loss_parallel=loss_parallel, **opts)
    mesh = tp_mesh(mesh)
    T = mesh.size()
    k = check(model, T)
    duplex(mesh.get_group())
    split, chain, kw, ag, col, row, norm = plan_styles(method, save_gathered, prefetch, opts)
    kv = FusedColwiseParallel(replicas=k, **ag)
    plan = {"model.embed_tokens": ReplicateParallel(),
            "model.layers.0": ShardSequence(split, prefetch=chain),
            "model.norm": norm, "lm_head": head_style(model, loss_parallel, ag)}
    H, G = model.config.num_attention_heads, model.config.num_key_value_heads
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        plan.update({p + "input_layernorm": norm, p + "post_attention_layernorm": norm,
                     p + "self_attn": FusedProjections(("q_proj", "k_proj", "v_proj"),
                                                       prefetch=chain, **ag),
                     p + "self_attn.q_proj": col, p + "self_attn.k_proj": kv,
                     p + "self_attn.v_proj": kv, p + "self_attn.o_proj": row,
                     p + "mlp": FusedProjections(("gate_proj", "up_proj"), prefetch=chain, **ag),
                     p + "mlp.gate_proj": col, p + "mlp.up_proj": col, p + "mlp.down_proj": row})
        attn = layer.self_attn
        for name in ("q_norm", "k_norm"):
            if isinstance(getattr(attn, name, None), nn.Module):
                plan[p + "self_attn." + name] = norm
        # local heads: H/T query heads over max(G/T, 1) kv heads (the views reshape by -1)
        attn.num_key_value_groups = (H // T) // max(G // T, 1)
        for name, n in (("num_heads", H // T), ("num_key_value_heads", max(G // T, 1))):
            if isinstance(getattr(attn, name, None), int):
                setattr(attn, name, n)
    parallelize_module(model, mesh, plan)
    if loss_parallel:
        install_loss_parallel(model, mesh.get_group())
    return model

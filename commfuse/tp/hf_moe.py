"""`parallelize_moe`: commfuse TPSP attention with expert parallelism on transformers'
Mixture-of-Experts causal LMs, in place (`commfuse.tp.parallelize` dispatches here for the
names in ``KNOWN``).

The expert-parallel group is the TP group: under TPSP a layer's MoE block already receives
this rank's sequence shard ``[B, s, D]``, so its tokens need no all-gather or
reduce-scatter; the block routes them with its own router (replicated), sends each (token,
expert) row to the rank that holds the expert and back, fused with the expert GEMMs
(`commfuse.moe.parallel.expert_ffn` on `commfuse.ops.moe`). No capacity, no dropped tokens.
The same contract as `commfuse.tp.parallelize` (the full ``input_ids`` on every rank, full
logits and loss, each ``.grad`` this rank's shard of the unsharded gradient). On T ranks:

    MixtralForCausalLM, Qwen3MoeForCausalLM
      model.embed_tokens, model.layers.0, model.norm, lm_head,
      *.input_layernorm, *.post_attention_layernorm, *.self_attn(.q_norm, .k_norm)
                                    as `commfuse.tp.hf` (Llama's plan)
      *.mlp (a sparse MoE block)    ExpertParallel (`commfuse.tp.experts`): experts Shard(0) (rank r holds experts
                                    r*E/T .. (r+1)*E/T - 1), router Replicate (grad summed)
      *.mlp (a dense MLP: Qwen3-MoE's mlp_only_layers / decoder_sparse_step)
                                    FusedProjections(gate, up), down_proj row-parallel

The router's auxiliary loss (``output_router_logits``) is the unsharded model's: while
transformers records the router logits, each block's router returns the whole sequence's
(one small all-gather of [B, s, E] per layer; its backward keeps this rank's rows), so
`load_balancing_loss_func` sees what the unsharded model's sees.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from commfuse.runtime.gloo import duplex
from commfuse.tp.experts import ExpertParallel, is_sparse
from commfuse.tp.hf_mamba import _attention
from commfuse.tp.loss import head_style, install_loss_parallel
from commfuse.tp.mesh import tp_mesh
from commfuse.tp.plan_styles import plan_styles
from commfuse.tp.style import FusedProjections, ReplicateParallel, ShardSequence

KNOWN = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
EXPERTS = {"MixtralForCausalLM": "num_local_experts", "Qwen3MoeForCausalLM": "num_experts"}
NORMS = ("input_layernorm", "post_attention_layernorm")


def _problems(model: nn.Module, T: int) -> list[str]:
    """What keeps ``model`` from running on T ranks (empty when it fits)."""
    cfg, have = model.config, dict(model.named_modules())
    missing = [n for n in ("model.embed_tokens", "model.layers", "model.norm", "lm_head")
               if n not in have]
    if missing:
        return [f"missing: {', '.join(missing)}"]
    problems = []
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        problems += [f"missing: {p}{n}" for n in NORMS + ("self_attn", "mlp")
                     if not isinstance(getattr(layer, n, None), nn.Module)]
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and not is_sparse(mlp) and not all(
                isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            problems.append(f"{p}mlp is neither a sparse MoE block (gate, experts.gate_up_proj, "
                            f"experts.down_proj) nor a SwiGLU MLP")
        if mlp is not None and is_sparse(mlp):
            extra = sorted(set(dict(mlp.named_parameters())) - {
                "gate.weight", "experts.gate_up_proj", "experts.down_proj"})
            if extra:
                problems.append(f"unsupported config: {p}mlp has parameters {extra} (shared "
                                f"experts, router or expert biases have no plan here)")
    E = getattr(cfg, EXPERTS.get(type(model).__name__, ""), None)
    if isinstance(E, int) and E % T:
        problems.append(f"{E} experts cannot be split over {T} ranks (expert parallelism "
                        f"needs the experts divisible by the TP size)")
    if getattr(cfg, "router_jitter_noise", 0):
        problems.append(f"unsupported config: router_jitter_noise={cfg.router_jitter_noise} "
                        f"(random noise on the router's input: set it to 0)")
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    if H % T:
        problems.append(f"num_attention_heads ({H}) must be divisible by the TP size ({T})")
    if G % T and T % G:
        problems.append(f"num_key_value_heads ({G}) and the TP size ({T}) must divide one "
                        f"another (kv heads are split, or replicated when fewer than ranks)")
    if model.lm_head.weight is model.model.embed_tokens.weight:
        problems.append("tied input/output embeddings are not supported by commfuse.tp "
                        "(the head is vocab-sharded, the embedding replicated): untie them")
    if model.lm_head.out_features < T:
        problems.append(f"vocab size ({model.lm_head.out_features}) is below the TP size ({T})")
    return problems


def check(model: nn.Module, T: int) -> None:
    """Raise a ValueError naming every problem if ``model`` cannot run on ``T`` ranks."""
    name = type(model).__name__
    problems = _problems(model, T) if name in KNOWN else [f"not one of {', '.join(KNOWN)}"]
    if problems:
        raise ValueError(f"commfuse.tp.parallelize cannot shard {name} as an MoE model: "
                         + "; ".join(problems))


def parallelize_moe(model: nn.Module, mesh: DeviceMesh, *, method: str = "auto",
                    save_gathered: bool = False, prefetch: bool = True, loss_parallel: bool = False,
                    **opts) -> nn.Module:
    """Shard ``model`` (one of ``KNOWN``, the same on every rank) over ``mesh`` (1-D, or its
    "tp" dim): TPSP attention, experts split over the same ranks, in place; returns it.
    Arguments as `commfuse.tp.parallelize`; ``method`` and ``opts`` also go to the MoE ops.
    Sets ``config.use_cache = False``: no generation cache under this plan."""
    mesh = tp_mesh(mesh)
    T = mesh.size()
    check(model, T)
    duplex(mesh.get_group())
    split, chain, kw, ag, col, row, norm = plan_styles(method, save_gathered, prefetch, opts)
    moe = ExpertParallel(split=split, method=method, **opts)
    plan = {"model.embed_tokens": ReplicateParallel(),
            "model.layers.0": ShardSequence(split, prefetch=chain),
            "model.norm": norm, "lm_head": head_style(model, loss_parallel, ag)}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        plan.update({p + n: norm for n in NORMS})
        plan.update(_attention(layer.self_attn, p + "self_attn", model.config, T, chain, ag,
                               col, row))
        plan.update({f"{p}self_attn.{n}": norm for n in ("q_norm", "k_norm")
                     if isinstance(getattr(layer.self_attn, n, None), nn.Module)})
        if is_sparse(layer.mlp):
            plan[p + "mlp"] = moe
        else:
            plan.update({p + "mlp": FusedProjections(("gate_proj", "up_proj"), prefetch=chain, **ag),
                         p + "mlp.gate_proj": col, p + "mlp.up_proj": col,
                         p + "mlp.down_proj": row})
    model.config.use_cache = False
    parallelize_module(model, mesh, plan)
    if loss_parallel:
        install_loss_parallel(model, mesh.get_group())
    return model

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
    NemotronHForCausalLM (one mixer per layer: Mamba-2, attention without RoPE, or a
    squared-ReLU MLP, by ``config.layers_block_type``)
      model.embeddings, model.layers.0, model.norm_f, lm_head, *.norm      as above
      *.mixer (linear_attention)    as Mamba2's *.mixer, *.mixer.out_proj
      *.mixer (full_attention)      FusedProjections(q, k, v) as Bamba's self_attn, o_proj row
      *.mixer (mlp)                 FusedProjections(up), down_proj row
      *.mixer (moe)                 ExpertParallel (`commfuse.tp.experts`): the routed experts
                                    split over the TP ranks, dispatch/combine fused with
                                    their GEMMs; router replicated; shared experts
                                    as the mlp layers (up AG->GEMM, down GEMM->RS)

Mixer parameters are DTensors; in_proj and conv1d are shards of the assembled weight
(`commfuse.tp.mamba`). Sets ``config.use_cache = False``: no generation cache under TP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from commfuse.runtime.gloo import duplex
from commfuse.tp.mamba import MambaMixerParallel, MixerLayout, mixer_layout
from commfuse.tp.attention import attention_plan, head_problems
from commfuse.tp.embedding import Partial, VocabParallelEmbedding, tie
from commfuse.tp.experts import ExpertParallel, expert_spec, is_sparse, spec_problems
from commfuse.tp.loss import head_style, install_loss_parallel
from commfuse.tp.mesh import tp_mesh
from commfuse.tp.plan_styles import plan_styles
from commfuse.tp.sequence import ReplicateParallel, ShardSequence
from commfuse.tp.style import FusedProjections

# class name -> (embedding, layers, final norm): the module names its plan uses
KNOWN = {"Mamba2ForCausalLM": ("backbone.embeddings", "backbone.layers", "backbone.norm_f"),
         "BambaForCausalLM": ("model.embed_tokens", "model.layers", "model.final_layernorm"),
         "NemotronHForCausalLM": ("model.embeddings", "model.layers", "model.norm_f")}
# a role's linears, relative to its module: what the plan shards
LINEARS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "swiglu": ("gate_proj", "up_proj", "down_proj"), "mlp": ("up_proj", "down_proj")}
NEMOTRON_H = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp",
              "moe": "moe"}


def layer_roles(name: str, layer: nn.Module, p: str) -> dict[str, str]:
    """Module name (prefix ``p``) -> role ("norm", "mamba", "attention", "swiglu", "mlp", "moe") of
    one layer of a ``KNOWN`` class; a role "missing: ..." or "unsupported: ..." marks what
    the plan cannot take."""
    if name == "Mamba2ForCausalLM":
        return {p + "norm": "norm", p + "mixer": "mamba"}
    if name == "BambaForCausalLM":
        kinds = [n for n in ("mamba", "self_attn") if isinstance(getattr(layer, n, None), nn.Module)]
        mixer = ({p + kinds[0]: "mamba" if kinds == ["mamba"] else "attention"} if len(kinds) == 1
                 else {p + "mamba or " + p + "self_attn (exactly one)": "missing"})
        return {p + "input_layernorm": "norm", p + "pre_ff_layernorm": "norm", **mixer,
                p + "feed_forward": "swiglu"}
    kind = getattr(layer, "block_type", None)
    role = NEMOTRON_H.get(kind, f"unsupported: a {kind!r} block (the plan takes "
                                f"{', '.join(NEMOTRON_H)})")
    return {p + "norm": "norm", p + "mixer": role}


def _missing(model: nn.Module, name: str) -> list[str]:
    have = dict(model.named_modules())
    emb, layers, final = KNOWN[name]
    missing = [n for n in (emb, layers, final, "lm_head") if n not in have]
    if missing:
        return missing
    if not isinstance(have[layers], nn.ModuleList) or not len(have[layers]):
        return [f"{layers} (a non-empty ModuleList)"]
    for i, layer in enumerate(have[layers]):
        for mod, role in layer_roles(name, layer, f"{layers}.{i}.").items():
            if role == "missing":
                missing.append(mod)
            elif role.startswith("unsupported"):
                missing.append(f"{mod}: {role}")
            elif mod not in have:
                missing.append(mod)
            elif role == "moe":
                if not is_sparse(have[mod]):
                    missing.append(f"{mod} (a sparse MoE block: gate.weight, experts.up_proj, "
                                   f"experts.down_proj)")
                missing += [f"{mod}.shared_experts.{n}" for n in LINEARS["mlp"]
                            if not isinstance(have.get(f"{mod}.shared_experts.{n}"), nn.Linear)]
            else:
                missing += [f"{mod}.{n}" for n in LINEARS.get(role, ())
                            if not isinstance(have.get(f"{mod}.{n}"), nn.Linear)]
    return missing


def _roles(model: nn.Module) -> dict[str, str]:
    name = type(model).__name__
    _, layers, _ = KNOWN[name]
    return {mod: role for i, layer in enumerate(model.get_submodule(layers))
            for mod, role in layer_roles(name, layer, f"{layers}.{i}.").items()}


def check(model: nn.Module, T: int) -> dict[str, MixerLayout]:
    """Raise if ``model`` cannot run on ``T`` TP ranks (a ValueError naming what is missing
    or what does not divide); return its mixers' layouts by module name."""
    name = type(model).__name__
    missing = _missing(model, name) if name in KNOWN else ["a known class"]
    if missing:
        raise ValueError(f"commfuse.tp.parallelize does not know {name} as a Mamba-2 model "
                         f"({', '.join(KNOWN)}); missing: {', '.join(missing)}")
    if model.lm_head.out_features < T:
        raise ValueError(f"vocab size ({model.lm_head.out_features}) is below the TP size ({T})")
    roles = _roles(model)
    if "attention" in roles.values():
        problems = head_problems(model.config, T)
        if problems:
            raise ValueError("; ".join(problems))
    for n, role in roles.items():
        if role == "moe":
            problems = spec_problems(expert_spec(model.get_submodule(n)), T)
            if problems:
                raise ValueError(f"{n}: " + "; ".join(problems))
    return {n: mixer_layout(model.get_submodule(n), T, n)
            for n, role in roles.items() if role == "mamba"}


def parallelize_mamba(model: nn.Module, mesh: DeviceMesh, *, method: str = "auto",
                      save_gathered: bool = False, prefetch: bool = True, loss_parallel: bool = False,
                      **opts) -> nn.Module:
    """Shard ``model`` (one of ``KNOWN``, the same on every rank) for commfuse TPSP over
    ``mesh`` (1-D, or its "tp" dim), in place; returns it. Arguments as
    `commfuse.tp.parallelize`."""
    mesh = tp_mesh(mesh)
    T = mesh.size()
    check(model, T)
    duplex(mesh.get_group())
    split, chain, kw, ag, col, row, norm = plan_styles(method, save_gathered, prefetch, opts)
    mixer = MambaMixerParallel(prefetch=chain, **ag)
    # the shared experts are a squared-ReLU MLP, TP-split as the "mlp" layers (their grads
    # replicated would cost an all-reduce of their weights every step); the latent
    # projections, if any, replicated
    moe = ExpertParallel(split=split, method=method,
                         replicate=("fc1_latent_proj", "fc2_latent_proj"), **opts)
    emb, layers, final = KNOWN[type(model).__name__]
    tied = model.lm_head.weight is model.get_submodule(emb).weight
    partial = Partial() if tied else None  # tied: the head's vocabulary rows, summed at layer 0
    plan = {emb: VocabParallelEmbedding(partial) if tied else ReplicateParallel(),
            f"{layers}.0": ShardSequence(split, prefetch=chain, partial=partial),
            final: norm, "lm_head": head_style(model, loss_parallel, ag)}
    for mod, role in _roles(model).items():
        if role == "norm":
            plan[mod] = norm
        elif role == "mamba":
            plan.update({mod: mixer, mod + ".out_proj": row})
        elif role == "moe":  # experts split over the TP ranks, on this rank's tokens
            plan[mod] = moe
            plan.update(_mlp(mod + ".shared_experts", "mlp", chain, ag, col, row))
        elif role == "attention":
            plan.update(attention_plan(model.get_submodule(mod), mod, model.config, T, chain, ag,
                                   col, row))
        else:
            plan.update(_mlp(mod, role, chain, ag, col, row))
    model.config.use_cache = False
    parallelize_module(model, mesh, plan)
    if tied:
        tie(model.get_submodule(emb), model.lm_head)
    if loss_parallel:
        install_loss_parallel(model, mesh.get_group())
    return model


def _mlp(name: str, role: str, chain, ag, col, row) -> dict:
    """A swiglu / mlp role's plan: the column-parallel projections fused, down_proj
    row-parallel."""
    ups = LINEARS[role][:-1]
    return {name: FusedProjections(ups, prefetch=chain, **ag),
            **{f"{name}.{n}": col for n in ups}, name + ".down_proj": row}

"""``commfuse train --hf-config PATH_OR_NAME``: a transformers causal LM built from a config (no
weights are downloaded), trained with `commfuse.tp` on the shipped corpus.

PATH_OR_NAME: a shipped config (`commfuse/data/hf/*.json`: ``commfuse train --help`` lists
them; Mamba-2 and Gated DeltaNet mixers run transformers' torch path), a ``config.json``
file or directory, or a Hugging Face hub name (its config only). ``--tp`` ranks run
`commfuse.tp.parallelize` (every fused op with ``--method`` and its options); ``--dp`` ranks shard the model with FSDP2
(``fully_shard`` per layer and at the root) over the "dp" dim of the (dp, tp) mesh. Not with
``--up``, ``--query-split`` or ``--resume`` (those are the built-in model's).
An MoE config (``mixtral-tiny``, ``qwen3-moe-tiny``, ``gpt-oss-tiny``, ``deepseek-v3-tiny``,
``nemotron-h-moe-tiny``) splits its experts over the ``--tp`` ranks, or over ``--ep`` ranks
drawn from the ``--dp`` ones (`commfuse.tp.experts`); the loss adds the router's auxiliary loss
where the config computes it (``output_router_logits``), times ``router_aux_loss_coef``, and
with ``--moe-seq-aux-coef`` / ``--moe-z-loss-coef`` the sequence-level aux loss and router
z-loss (`commfuse.tp.router_loss`); ``--moe-capacity-factor`` caps each expert's rows
(`commfuse.moe.capacity`; one process applies it to the whole batch).
``--checkpoint-dir D`` saves the whole model as a transformers model directory (config.json,
model.safetensors: `save_hf_checkpoint`) at D/step-N, named by D/latest, which ``commfuse
generate --checkpoint D`` and ``from_pretrained`` read. The loss is the next-token
cross-entropy on ``targets``, vocabulary-parallel under TP (``loss_parallel=True``: the
head's logits stay sharded over the vocabulary, `commfuse.tp.loss`); MFU uses 6N + 12 L H Q T (PaLM, appendix B) with the config's
sizes, plus the Mamba-2 scan on Mamba layers (`commfuse.train.hf_flops`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from commfuse.data import DATA_DIR, VOCAB_SIZE, batches, load_corpus_tokens
from commfuse.tp.balance import ExpertLoad, imbalance, limit_capacity, take_dropped
from commfuse.tp.router_loss import RouterLosses
from commfuse.train.config import DTYPES, TrainConfig
from commfuse.train.hf_flops import EXPERTS, num_experts
from commfuse.train.report import finish, measure_matmul_flops, progress

SHIPPED = DATA_DIR / "hf"
ATTENTION_FREE = ("mamba2",)  # model types whose class takes no attn_implementation
def has_experts(hf) -> bool:
    """Whether the config has sparse MoE layers (Mixtral, Qwen3-MoE, gpt-oss, ..., Nemotron-H
    with "moe")."""
    return bool(num_experts(hf)) and (
        hf.model_type != "nemotron_h" or "moe" in (getattr(hf, "layers_block_type", None) or ()))


def load_config(name_or_path: str):
    """The transformers config of a shipped name, a file or directory, or a hub name."""
    from transformers import AutoConfig
    shipped = SHIPPED / f"{name_or_path}.json"
    return AutoConfig.from_pretrained(str(shipped if shipped.is_file() else name_or_path))


def _check(cfg: TrainConfig, hf) -> None:
    unsupported = [flag for flag, on in (("--up", cfg.up > 1), ("--query-split", cfg.query_split),
                                         ("--resume", cfg.resume)) if on]
    if unsupported:
        raise ValueError(f"--hf-config does not take {', '.join(unsupported)}")
    if hf.vocab_size < VOCAB_SIZE:
        raise ValueError(f"the config's vocab_size ({hf.vocab_size}) is below the shipped "
                         f"tokenizer's ({VOCAB_SIZE})")
    if cfg.batch_size % cfg.dp:
        raise ValueError(f"global batch size ({cfg.batch_size}) must be divisible by dp ({cfg.dp})")
    moe = [f for f, on in (("--ep", cfg.ep is not None), ("--moe-seq-aux-coef", cfg.moe_seq_aux_coef),
                           ("--moe-z-loss-coef", cfg.moe_z_loss_coef),
                           ("--moe-capacity-factor", cfg.moe_capacity_factor)) if on]
    if moe and not has_experts(hf):
        raise ValueError(f"{', '.join(moe)} needs a mixture-of-experts config (one with "
                         f"{' / '.join(EXPERTS)}), got {hf.model_type}")
    if cfg.ep is not None and (cfg.ep % cfg.tp or (cfg.tp * cfg.dp) % cfg.ep):
        raise ValueError(f"--ep ({cfg.ep}) must be a multiple of --tp ({cfg.tp}) that divides "
                         f"tp*dp ({cfg.tp * cfg.dp}): each expert group is whole tp groups")


def build(cfg: TrainConfig, world: int):
    """(model, dp mesh or None): the model from the config, parallelized for tp x dp."""
    from transformers import AutoModelForCausalLM
    hf = load_config(cfg.hf_config)
    _check(cfg, hf)
    torch.manual_seed(cfg.seed)
    attn = {} if hf.model_type in ATTENTION_FREE else {"attn_implementation": "sdpa"}
    try:
        model = AutoModelForCausalLM.from_config(hf, **attn)
    except ValueError:  # a family without sdpa (Gemma 2's soft-capping, gpt-oss's sinks)
        model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager")
    model = model.to(DTYPES[cfg.dtype])
    if world == 1:
        if cfg.moe_capacity_factor is not None:  # one rank: its tokens are the whole batch
            limit_capacity(model, cfg.moe_capacity_factor)
        return model, None
    import commfuse.tp
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    # loss_parallel: the head keeps its vocabulary columns; the loss needs no [B, S, V] gather
    # defer_grad_sums: the loop reads .grad only after backward() (FSDP2's parameters keep
    # the blocking sums)
    commfuse.tp.parallelize(model, mesh, method=cfg.method, loss_parallel=True, ep=cfg.ep,
                            capacity_factor=cfg.moe_capacity_factor, defer_grad_sums=True,
                            **cfg.method_opts())
    if cfg.dp == 1:
        return model, None
    from torch.distributed.fsdp import fully_shard

    from commfuse.tp.experts import expert_parameters
    from commfuse.tp.plan import base_model
    ignored = expert_parameters(model)  # experts split over dp ranks: already their mean
    for layer in base_model(model)[1].layers:  # model.layers, Mamba2's backbone.layers
        fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
    fully_shard(model, mesh=mesh["dp"], ignored_params=ignored)
    return model, mesh["dp"]


def _flops_per_token(hf, seq_len: int) -> int:
    """6N + 12 L H Q T (+ the Mamba-2 scan): `commfuse.train.hf_flops.flops_per_token`."""
    from commfuse.train.hf_flops import flops_per_token
    return flops_per_token(hf, seq_len)


def train_hf_rank(rank: int, world: int, cfg: TrainConfig, lr_at, seq_len_at) -> list[dict]:
    """One rank's training loop (as `commfuse.train.loop.train_rank`, for --hf-config), with
    that loop's LR schedule ``lr_at(cfg, step)`` and length walk ``seq_len_at(cfg, step)``,
    passed in by it."""
    if world != cfg.world:
        raise ValueError(f"{world} ranks but tp*dp = {cfg.world}")
    model, dp_mesh = build(cfg, world)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    dp_index = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    data = batches(load_corpus_tokens(), cfg.batch_size // cfg.dp, cfg.seq_len, cfg.seed,
                   rank=dp_index, world=cfg.dp)
    peak = cfg.peak_flops or measure_matmul_flops(dtype=DTYPES[cfg.dtype])
    show = cfg.progress and rank == 0
    if show:
        print(f"commfuse train: {type(model).__name__.removeprefix('FSDP')} from "
              f"{cfg.hf_config}, tp={cfg.tp} "
              f"dp={cfg.dp} method={cfg.method} {cfg.method_opts()}, batch "
              f"{cfg.batch_size}x{cfg.seq_len}, {cfg.steps} steps", flush=True)
    load = ExpertLoad(model)  # per-expert token counts of the MoE layers (none: dense)
    router = RouterLosses(model, seq_aux=cfg.moe_seq_aux_coef, z=cfg.moe_z_loss_coef)
    metrics: list[dict] = []
    for step in range(min(cfg.steps, cfg.stop_after or cfg.steps)):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        tokens, targets = next(data)
        if cfg.variable_length:
            n = seq_len_at(cfg, step)
            tokens, targets = tokens[:, :n], targets[:, :n]
        out = model(tokens)
        # next-token cross-entropy (vocabulary-parallel under TP: the logits are sharded)
        loss = model.loss_function(out.logits, None, vocab_size=model.config.vocab_size,
                                   shift_labels=targets)
        if getattr(out, "aux_loss", None) is not None:  # MoE: the router's, as the model adds it
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss = loss + router.take()  # the sequence-level aux loss and z-loss (0: off)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts = load.take()  # over every rank: each counted its own tokens
        moe = {}
        if cfg.moe_seq_aux_coef or cfg.moe_z_loss_coef:  # this dp rank's batch's terms
            moe = {k: v.item() for k, v in router.last.items()}
        if (dropped := take_dropped(model)) is not None:
            moe["dropped"] = dropped
        if cfg.expert_bias_rate:
            load.update_bias(counts, cfg.expert_bias_rate)
        loss = loss.detach()
        if dp_mesh is not None:  # every dp rank's batch has the same token count
            dist.all_reduce(loss, group=dp_mesh.get_group())
            loss /= cfg.dp
        dt = time.perf_counter() - t0
        tps = tokens.numel() * cfg.dp / dt
        metrics.append({"step": step + 1, "loss": loss.item(), "step_s": dt,
                        "tokens_per_s": tps, "lr": lr_at(cfg, step), "seq_len": tokens.shape[1],
                        "mfu": _flops_per_token(model.config, tokens.shape[1]) * tps
                        / (peak * world),
                        **({"experts": imbalance(counts)} if counts else {}),
                        **({"moe": moe} if moe else {})})
        if show:
            progress(metrics, cfg.steps)
        if cfg.checkpoint_dir and (step + 1 in (cfg.steps, cfg.stop_after) or (
                cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
            save_hf_checkpoint(model, cfg.checkpoint_dir, step + 1, rank, cfg.tp)
    summary = {"exposed_comm_s": None, "peak_flops_per_rank": peak}
    return finish(cfg, rank, world, metrics, summary, show)


def save_hf_checkpoint(model, root: str, step: int, rank: int, tp: int) -> str:
    """The whole ``model`` (every rank calls: its DTensor shards are gathered) saved by rank 0
    as a transformers model directory ``root/step-N`` (written to ``root/.tmp-step-N`` and
    renamed when complete), then named by ``root/latest`` (replaced atomically). k/v
    projections that `commfuse.tp` replicated over ranks (fewer kv heads than ranks) are
    saved once; Mamba-2 and Gated DeltaNet mixers' assembled in_proj / conv1d rows are saved
    in the model's layout, packed projections (Phi-3's q|k|v) in the model's row order, a tied embedding
    once. Returns the directory."""
    import os
    import shutil
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    from commfuse.tp.attention import unpack_rows

    state = {}
    for mod_name, mod in model.named_modules():
        # replicated kv blocks, packed projections and their split norms, the mixers'
        # assembled in_proj / conv1d rows (Mamba-2, Gated DeltaNet): the model's rows
        style = next((getattr(mod, a) for a in ("_commfuse_colwise", "_commfuse_split_norm",
                                                "_commfuse_rows") if hasattr(mod, a)), None)
        for name, p in mod.named_parameters(recurse=False):
            t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if style is not None:
                t = unpack_rows(style, t, tp)
            state[f"{mod_name}.{name}".lstrip(".")] = t.contiguous().cpu()
    final = os.path.join(root, f"step-{step:08d}")
    if rank == 0:
        from safetensors.torch import save_file

        tmp, latest = os.path.join(root, f".tmp-step-{step:08d}"), os.path.join(root, "latest")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.config.save_pretrained(tmp)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        Path(latest + ".tmp").write_text(os.path.basename(final))
        os.replace(latest + ".tmp", latest)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return final

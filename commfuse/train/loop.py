"""The training loop of ``commfuse train`` (see `commfuse.train`): launch, one rank's steps,
the LR schedule and the variable sequence length."""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commfuse.ops.auto import use_hardware
from commfuse.runtime.gloo import duplex
from commfuse.train.config import DTYPES, TrainConfig
from commfuse.train.report import exposed, finish, measure_matmul_flops, progress


def launch(cfg: TrainConfig, rank_fn=None):
    """Train under torchrun (env), in this process (1 rank), or on spawned local ranks.

    Returns what ``rank_fn(rank, world, cfg)`` (default `train_rank`: the per-step metrics,
    losses global) returns on this rank (rank 0's when spawning).
    """
    rank_fn = rank_fn or train_rank
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not dist.is_initialized():
            if cfg.device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            from commfuse.testbed.spawn import pg_options

            backend = "nccl" if cfg.device == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout),
                                    pg_options=pg_options(backend))
            duplex()  # one connection per direction between two ranks (commfuse.runtime.gloo)
        return rank_fn(dist.get_rank(), dist.get_world_size(), cfg)
    if cfg.world == 1:
        return rank_fn(0, 1, cfg)
    from commfuse.testbed.spawn import run_local

    threads = max(1, (os.cpu_count() or 1) // cfg.world)
    return run_local(rank_fn, cfg.world, cfg, threads=threads, timeout=24 * 3600,
                     pg_timeout_s=cfg.timeout,
                     backend="nccl" if cfg.device == "cuda" else "gloo")[0]


def seq_len_at(cfg: TrainConfig, step: int) -> int:
    """Tokens per sequence at ``step`` with ``variable_length``: a fixed pseudo-random walk
    over seq_len/2..seq_len (the same on every rank and on resume)."""
    half = cfg.seq_len // 2
    return cfg.seq_len - (step * 7919 + 13) % (cfg.seq_len - half + 1)


def lr_at(cfg: TrainConfig, step: int) -> float:
    import math

    warm = max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_rank(rank: int, world: int, cfg: TrainConfig) -> list[dict]:
    """One rank's training loop; returns its per-step metrics (rank 0 prints and writes)."""
    device = device_of(cfg)
    fit_cost_model(cfg, rank, device)
    if cfg.hf_config:
        from commfuse.train.hf import train_hf_rank
        return train_hf_rank(rank, world, cfg, lr_at, seq_len_at)
    run = build_llama(cfg, world, device)
    data = llama_batches(run)
    peak = cfg.peak_flops or measure_matmul_flops(dtype=DTYPES[cfg.dtype], device=device)
    show = cfg.progress and rank == 0
    metrics: list[dict] = []
    if show:
        print(header(run, peak, world), flush=True)
    for step in range(run.start, last_step(cfg)):
        tokens, targets = batch_at(cfg, data, step, device)
        metrics.append(llama_step(run, step, tokens, targets, peak, world))
        if show:
            progress(metrics, cfg.steps)
        save_if_due(run, step, world)
    summary = {"exposed_comm_s": None, "peak_flops_per_rank": peak}
    if metrics and cfg.exposed_iters and world > 1:
        summary.update(exposed(run.pmodel, tokens, targets, cfg.exposed_iters))
    return finish(cfg, rank, world, metrics, summary, show)  # every rank its own (global losses)


def device_of(cfg: TrainConfig) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" \
        else torch.device("cpu")


def fit_cost_model(cfg: TrainConfig, rank: int, device: torch.device) -> None:
    """auto's cost model on this machine's compute (a GEMM per rank, one all-reduce), fitted
    only where the method consults it (the fit takes seconds); rank 0 says which."""
    if cfg.hardware == "measured" and not cfg.consults_cost_model:
        line = f"hardware model: not fitted (method {cfg.method} consults no cost model)"
    else:
        _, line = use_hardware(cfg.hardware,
                               torch.empty(0, dtype=DTYPES[cfg.dtype], device=device))
    if cfg.progress and rank == 0:
        print(f"commfuse train: {line}", flush=True)


@dataclass
class LlamaRun:
    """One built-in Llama's training state on this rank (`build_llama`)."""

    cfg: TrainConfig
    mcfg: object
    """The model's `LlamaConfig`."""
    dims: object
    """Its `ParallelDims` (the layout and method)."""
    mesh: object
    """Its process groups (`ParallelDims.build_mesh`), None for one process."""
    pmodel: torch.nn.Module
    """The `ParallelLlama`."""
    opt: torch.optim.Optimizer
    start: int
    """The step it starts at (a resumed checkpoint's, else 0)."""


def build_llama(cfg: TrainConfig, world: int, device: torch.device) -> LlamaRun:
    """The preset's Llama (seeded: the same full model on every rank, and for every call with
    the same ``cfg.seed``), parallelized by ``cfg``'s layout and method on process groups of
    its own, its AdamW, resumed from ``cfg.checkpoint_dir`` with ``cfg.resume``."""
    from commfuse.models.llama import Llama, LlamaConfig
    from commfuse.parallel.checkpoint import load_checkpoint
    from commfuse.parallel.config import ParallelDims
    from commfuse.parallel.plan import parallelize

    dims = ParallelDims(cfg.tp, cfg.up, cfg.dp, cfg.method, cfg.method_opts(),
                        query_split=cfg.query_split or (False if cfg.no_query_split else None),
                        world_size=world,
                        prefetch=cfg.prefetch, prefetch_mb=cfg.prefetch_mb,
                        defer_reduce=not cfg.reduce_in_op,
                        regather_prefetch=0 if cfg.no_regather_prefetch else 1)
    mcfg = LlamaConfig.preset(cfg.preset, **{"max_seq_len": max(cfg.seq_len, 1), **cfg.model})
    dims.check_model(mcfg, cfg.seq_len, cfg.batch_size)
    torch.manual_seed(cfg.seed)  # the same full model on every rank; the plan cuts it
    model = Llama(mcfg).to(DTYPES[cfg.dtype]).to(device)
    mesh = dims.build_mesh() if world > 1 else None
    pmodel = parallelize(model, mesh, bucket_mb=cfg.bucket_mb)
    params = list(pmodel.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    start = 0
    if cfg.resume:
        if not cfg.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (--checkpoint-dir)")
        start = load_checkpoint(pmodel, opt, cfg.checkpoint_dir, _layout(cfg, world))
    return LlamaRun(cfg, mcfg, dims, mesh, pmodel, opt, start)


def llama_batches(run: LlamaRun):
    """This rank's batches of the corpus from ``run.start`` on (its DP replica's rows)."""
    from commfuse.data import batches, load_corpus_tokens

    cfg = run.cfg
    return batches(load_corpus_tokens(), cfg.batch_size // cfg.dp, cfg.seq_len, cfg.seed,
                   rank=run.mesh.dp_index if run.mesh else 0, world=cfg.dp,
                   start_step=run.start)


def last_step(cfg: TrainConfig) -> int:
    """The step a run ends at: ``steps``, or ``stop_after`` (a simulated interruption)."""
    return min(cfg.steps, cfg.stop_after or cfg.steps)


def batch_at(cfg: TrainConfig, data, step: int, device: torch.device):
    """The next (tokens, targets) of ``data`` on ``device``, cut to `seq_len_at` with
    ``variable_length``."""
    tokens, targets = (t.to(device) for t in next(data))
    if cfg.variable_length:
        n = seq_len_at(cfg, step)
        tokens, targets = tokens[:, :n], targets[:, :n]
    return tokens, targets


def llama_step(run: LlamaRun, step: int, tokens, targets, peak: float, world: int) -> dict:
    """One optimizer step of ``run`` on this batch; its metrics (the loss is global)."""
    from commfuse.models.llama import flops_per_token

    cfg, pmodel, opt = run.cfg, run.pmodel, run.opt
    t0 = time.perf_counter()
    for g in opt.param_groups:
        g["lr"] = lr_at(cfg, step)
    local = pmodel.loss(tokens, targets)
    local.backward()
    pmodel.sync_grads()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = pmodel.global_loss(local)
    dt = time.perf_counter() - t0
    tps = tokens.numel() * cfg.dp / dt
    return {"step": step + 1, "loss": loss, "step_s": dt, "tokens_per_s": tps,
            "mfu": flops_per_token(run.mcfg, tokens.shape[1]) * tps / (peak * world),
            "lr": lr_at(cfg, step), "seq_len": tokens.shape[1]}


def save_if_due(run: LlamaRun, step: int, world: int) -> None:
    """Save ``run`` after ``step`` where ``--checkpoint-dir`` / ``--checkpoint-every`` ask."""
    from commfuse.parallel.checkpoint import save_checkpoint

    cfg = run.cfg
    if cfg.checkpoint_dir and (step + 1 in (cfg.steps, cfg.stop_after) or (
            cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
        save_checkpoint(run.pmodel, run.opt, cfg.checkpoint_dir, step + 1, _layout(cfg, world))


def header(run: LlamaRun, peak: float, world: int) -> str:
    """The line rank 0 prints before the first step."""
    cfg = run.cfg
    params = sum(p.numel() for p in run.pmodel.parameters())
    return (f"commfuse train: {cfg.preset} {params} local params, tp={cfg.tp} up={cfg.up} "
            f"dp={cfg.dp} method={cfg.method} "
            f"{f'prefetch={cfg.prefetch} ' if cfg.dp > 1 else ''}"
            f"{run.dims.method_opts}, batch {cfg.batch_size}x{cfg.seq_len}, "
            f"steps {run.start}..{cfg.steps}, peak {peak / 1e9:.1f} GFLOP/s per rank, link "
            f"{os.environ.get('COMMFUSE_LINK', 'loopback' if world > 1 else 'none')}")


def _layout(cfg: TrainConfig, world: int) -> dict:
    """What a checkpoint must match to be resumed (recorded beside it)."""
    return {"tp": cfg.tp, "up": cfg.up, "dp": cfg.dp, "world": world, "preset": cfg.preset,
            "model": cfg.model, "dtype": cfg.dtype}

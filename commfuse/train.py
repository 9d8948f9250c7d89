"""``commfuse train``: train a Llama on the shipped corpus with TP / UP / DP applied by a plan.

Local mode spawns ``--nproc`` ranks (gloo, `commfuse.spawn.run_local`); under ``torchrun`` (or
``commfuse launch``) the RANK / WORLD_SIZE / LOCAL_RANK environment is detected and the process
group is initialised from it instead. One rank (``--nproc 1``) runs in this process, unsharded.

Per step: the global mean loss, tokens/s, MFU = flops_per_token * tokens/s / peak, where
flops_per_token is `commfuse.models.llama.flops_per_token` (6N + 12*L*H*Q*T, PaLM appendix B,
as nanoGPT) and peak is ``--peak-flops`` per rank, or a dense matmul measured on each rank at
startup (CPUs publish no usable peak). Exposed communication is measured once, after training:
the median fwd+bwd(+grad all-reduce) time minus the median of the same fwd+bwd with the
executor in ``compute_only`` mode (same partitioned GEMMs, no transfers), interleaved. It is not
measured per step (that would double the work). The plain gradient all-reduce counts as exposed;
the other plain collectives (the loss's token count, the DP weight all-gather under TP/UP x DP)
still run in compute_only mode, so they count as compute: the figure is a lower bound.
--compare-none runs the same steps again with method none afterwards (sequential, not
interleaved): same losses up to summation order, and the ratio of median step times.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from commfuse._p2p import duplex
from commfuse.train_report import exposed, measure_matmul_flops, progress, report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainConfig:
    """One training run; the fields mirror the ``commfuse train`` flags."""

    tp: int = 1
    """Tensor(+sequence) parallel ranks."""
    up: int = 1
    """Ulysses sequence-parallel ranks (not with tp > 1)."""
    dp: int = 1
    """Sharded data-parallel (ZeRO-3) ranks."""
    method: str = "commfuse"
    """Schedule of every fused op: none, sliced, decompose, commfuse."""
    topology: str = "ring"
    """decompose / commfuse: ring or direct."""
    chunks: int = 4
    """sliced: chunks per op."""
    query_split: bool = False
    """TP attention runs attention + out-projection per query slice inside the RS ring."""
    splits: int = 1
    """decompose / commfuse: sub-slices per rank's slice (m; 4 hid the most in the layer
    benchmarks of docs/benchmarks/2026-11-29.md)."""
    steps: int = 150
    """Optimizer steps of the whole run (a resumed run continues to this step)."""
    seed: int = 0
    """Model init and data order."""
    batch_size: int = 8
    """Global batch (sequences per step), split over the DP ranks."""
    seq_len: int = 128
    """Tokens per sequence (any length: tp / up split it as evenly as it goes)."""
    variable_length: bool = False
    """Step i trains on the first `seq_len_at` (seq_len/2..seq_len) tokens of each sequence,
    so the length, and with it every sequence split, changes from step to step."""
    lr: float = 3e-3
    """Peak learning rate: linear warm-up over steps/20, cosine decay to lr/10 (a function of
    the step, so a resumed run follows the same schedule)."""
    weight_decay: float = 0.1
    """AdamW decay of the matrices (not of norms)."""
    dtype: str = "float32"
    """Parameters and activations (float32 or bfloat16; no float32 master weights)."""
    preset: str = "tiny"
    """A `LlamaConfig.preset` name."""
    model: dict = field(default_factory=dict)
    """LlamaConfig fields overriding the preset."""
    peak_flops: float | None = None
    """Peak FLOP/s of one rank; None: measure a dense matmul at startup."""
    metrics_json: str | None = None
    """Rank 0 writes {config, world, steps: [per-step metrics], summary} here as JSON."""
    checkpoint_dir: str | None = None
    """Where DCP checkpoints go (DIR/step-N, DIR/latest); None: no checkpoints."""
    checkpoint_every: int = 0
    """Save every N steps (0: only at the end / at stop_after)."""
    resume: bool = False
    """Start from DIR/latest (same tp/up/dp and model); from scratch if there is none."""
    stop_after: int | None = None
    """Stop after this step as if interrupted (the LR schedule still spans ``steps``)."""
    exposed_iters: int = 3
    """fwd+bwd pairs (normal / compute_only) timed after training; 0: not measured."""
    progress: bool = True
    """Rank 0 prints a header, progress lines and a summary."""
    timeout: float = 60.0
    """Seconds a rank waits for a peer (every op's ``timeout`` and the process group's) before
    the run fails with an error naming the op, step and peer."""

    @property
    def world(self) -> int:
        return self.tp * self.up * self.dp

    def method_opts(self) -> dict:
        """The method's options among the flags (only those the method accepts)."""
        from commfuse.ops._common import OPTIONS

        given = {"chunks": self.chunks, "topology": self.topology, "splits": self.splits,
                 "timeout": self.timeout}
        return {k: v for k, v in given.items() if k in OPTIONS[self.method]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``commfuse train`` flags (the lead wires them: ``set_defaults(run=run)``)."""
    a = p.add_argument
    a("--tp", type=int, help="tensor(+sequence) parallel ranks (default 2 if none of "
      "--tp/--up/--dp is given, else 1)")
    a("--up", type=int, help="Ulysses sequence-parallel ranks (default 1; not with --tp > 1)")
    a("--dp", type=int, help="sharded data-parallel (ZeRO-3) ranks (default 1)")
    a("--nproc", type=int, help="local ranks to spawn (default tp*up*dp; ignored under torchrun)")
    a("--method", default="commfuse", choices=["none", "sliced", "decompose", "commfuse", "auto"],
      help="schedule of every fused op (default commfuse)")
    a("--topology", default="ring", choices=["ring", "direct"], help="decompose/commfuse (ring)")
    a("--chunks", type=int, default=4, help="chunks of method sliced (default 4)")
    a("--query-split", action="store_true", help="with --tp: query-split attention (attention "
      "and the out-projection partial per query slice, inside the reduce-scatter ring)")
    a("--splits", type=int, default=1, help="sub-slices per rank's slice for decompose/commfuse "
      "(default 1, the paper's; 4 hid the most communication in our layer benchmarks)")
    a("--steps", type=int, default=150, help="optimizer steps (default 150)")
    a("--seed", type=int, default=0, help="model init and data order (default 0)")
    a("--batch-size", type=int, default=8, help="global batch in sequences (default 8)")
    a("--seq-len", type=int, default=128, help="tokens per sequence (default 128; any length, "
      "split over tp/up as evenly as it goes)")
    a("--variable-length", action="store_true", help="train step i on a prefix of each "
      "sequence whose length varies from step to step (seq-len/2 .. seq-len): every step "
      "splits its sequence differently")
    a("--lr", type=float, default=3e-3, help="peak LR; warm-up steps/20, cosine to lr/10")
    a("--dtype", default="float32", choices=list(DTYPES), help="parameters and activations")
    a("--preset", default="tiny", help="LlamaConfig preset (default tiny)")
    a("--peak-flops", type=float, help="peak FLOP/s of one rank for MFU (default: measured "
      "at startup with a dense 512x512 matmul on each rank, since a CPU core's peak is unknown)")
    a("--metrics-json", metavar="FILE", help="write config, per-step metrics and summary")
    a("--checkpoint-dir", metavar="DIR", help="torch.distributed.checkpoint directory")
    a("--checkpoint-every", type=int, default=0, metavar="N",
      help="save every N steps and at the end (default: only at the end, if --checkpoint-dir)")
    a("--resume", action="store_true", help="continue from DIR/latest (same tp/up/dp)")
    a("--timeout", type=float, default=60.0, metavar="S", help="seconds a rank waits for a "
      "peer before the run fails naming the op, step and peer (default 60)")
    a("--compare-none", action="store_true", help="after the run, re-run the same steps with "
      "--method none (no checkpoints) and print the loss difference and step-time ratio")


def config_from_args(args) -> TrainConfig:
    """The TrainConfig of parsed flags; no --tp/--up/--dp at all means tp=2."""
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"tp", "up", "dp", "model"}
    cfg = TrainConfig(**{n: getattr(args, n) for n in names if hasattr(args, n)})
    cfg.tp = args.tp or (1 if args.up or args.dp else 2)
    cfg.up, cfg.dp = args.up or 1, args.dp or 1
    if args.nproc is not None and args.nproc != cfg.world:
        raise SystemExit(f"commfuse train: --nproc {args.nproc} != tp*up*dp = {cfg.world}")
    return cfg


def run(args) -> int:
    """``commfuse train``: train, then (--compare-none) the same steps again with method none.

    A failed rank (a dead or stalled peer, any exception) ends the run with exit code 1 and
    a message naming the last complete checkpoint to ``--resume`` from."""
    from commfuse.errors import CommFuseError
    from commfuse.spawn import RankFailed

    cfg = config_from_args(args)
    try:
        first = launch(cfg)
    except (RankFailed, CommFuseError, TimeoutError) as e:
        print(f"commfuse train: failed: {e}", file=sys.stderr)
        latest = Path(cfg.checkpoint_dir or "", "latest")
        print(f"commfuse train: last complete checkpoint: "
              f"{latest.parent / latest.read_text().strip() if latest.is_file() else 'none'}"
              f"{' (continue with --resume)' if latest.is_file() else ''}", file=sys.stderr)
        return 1
    if getattr(args, "compare_none", False) and cfg.method != "none":
        base = launch(dataclasses.replace(cfg, method="none", checkpoint_dir=None, resume=False,
                                          metrics_json=None))
        if first and base and int(os.environ.get("RANK", 0)) == 0:
            diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(first, base))
            t = lambda ms: statistics.median(m["step_s"] for m in ms[1:] or ms)
            print(f"compare-none: max |loss - loss(none)| = {diff:.3g}; median step "
                  f"{cfg.method} {t(first) * 1e3:.1f} ms / none {t(base) * 1e3:.1f} ms = "
                  f"{t(first) / t(base):.3f}")
    return 0


def launch(cfg: TrainConfig) -> list[dict]:
    """Train under torchrun (env), in this process (1 rank), or on spawned local ranks.

    Returns this rank's per-step metrics (rank 0's when spawning); losses are global.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout))
            duplex()  # one connection per direction between two ranks (commfuse._p2p)
        return train_rank(dist.get_rank(), dist.get_world_size(), cfg)
    if cfg.world == 1:
        return train_rank(0, 1, cfg)
    from commfuse.spawn import run_local

    threads = max(1, (os.cpu_count() or 1) // cfg.world)
    return run_local(train_rank, cfg.world, cfg, threads=threads, timeout=24 * 3600,
                     pg_timeout_s=cfg.timeout)[0]


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
    from commfuse.data import batches, load_corpus_tokens
    from commfuse.models.llama import Llama, LlamaConfig, flops_per_token
    from commfuse.parallel import (ParallelDims, load_checkpoint, parallelize,
                                   save_checkpoint)

    dims = ParallelDims(cfg.tp, cfg.up, cfg.dp, cfg.method, cfg.method_opts(),
                        query_split=cfg.query_split, world_size=world)
    mcfg = LlamaConfig.preset(cfg.preset, **{"max_seq_len": max(cfg.seq_len, 1), **cfg.model})
    dims.check_model(mcfg, cfg.seq_len, cfg.batch_size)
    torch.manual_seed(cfg.seed)  # the same full model on every rank; the plan cuts it
    model = Llama(mcfg).to(DTYPES[cfg.dtype])
    mesh = dims.build_mesh() if world > 1 else None
    pmodel = parallelize(model, mesh)
    params = list(pmodel.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    start = 0
    if cfg.resume:
        if not cfg.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (--checkpoint-dir)")
        start = load_checkpoint(pmodel, opt, cfg.checkpoint_dir, _layout(cfg, world))
    dp_index = mesh.dp_index if mesh else 0
    data = batches(load_corpus_tokens(), cfg.batch_size // cfg.dp, cfg.seq_len, cfg.seed,
                   rank=dp_index, world=cfg.dp, start_step=start)
    peak = cfg.peak_flops or measure_matmul_flops(dtype=DTYPES[cfg.dtype])
    show = cfg.progress and rank == 0
    metrics: list[dict] = []
    if show:
        print(f"commfuse train: {cfg.preset} {sum(p.numel() for p in model.parameters())} local "
              f"params, tp={cfg.tp} up={cfg.up} dp={cfg.dp} method={cfg.method} "
              f"{dims.method_opts}, batch {cfg.batch_size}x{cfg.seq_len}, "
              f"steps {start}..{cfg.steps}, peak {peak / 1e9:.1f} GFLOP/s per rank", flush=True)
    for step in range(start, min(cfg.steps, cfg.stop_after or cfg.steps)):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        tokens, targets = next(data)
        if cfg.variable_length:
            n = seq_len_at(cfg, step)
            tokens, targets = tokens[:, :n], targets[:, :n]
        local = pmodel.loss(tokens, targets)
        local.backward()
        pmodel.sync_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = pmodel.global_loss(local)
        dt = time.perf_counter() - t0
        tps = tokens.numel() * cfg.dp / dt
        metrics.append({"step": step + 1, "loss": loss, "step_s": dt, "tokens_per_s": tps,
                        "mfu": flops_per_token(mcfg, tokens.shape[1]) * tps / (peak * world),
                        "lr": lr_at(cfg, step), "seq_len": tokens.shape[1]})
        if show:
            progress(metrics, cfg.steps)
        if cfg.checkpoint_dir and (step + 1 in (cfg.steps, cfg.stop_after) or (
                cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
            save_checkpoint(pmodel, opt, cfg.checkpoint_dir, step + 1, _layout(cfg, world))
    summary = {"exposed_comm_s": None, "peak_flops_per_rank": peak}
    if metrics and cfg.exposed_iters and world > 1:
        summary.update(exposed(pmodel, tokens, targets, cfg.exposed_iters))
    if metrics:
        steady = metrics[1:] or metrics  # the first step warms up
        med = lambda key: statistics.median(m[key] for m in steady)
        summary.update(median_step_s=med("step_s"), final_loss=metrics[-1]["loss"],
                       median_tokens_per_s=med("tokens_per_s"), median_mfu=med("mfu"))
    if show:
        report(summary)
    if rank == 0 and cfg.metrics_json:
        Path(cfg.metrics_json).write_text(json.dumps({"config": dataclasses.asdict(cfg),
            "world": world, "steps": metrics, "summary": summary}, indent=1))
    return metrics  # every rank returns its own (the losses are global)


def _layout(cfg: TrainConfig, world: int) -> dict:
    """What a checkpoint must match to be resumed (recorded beside it)."""
    return {"tp": cfg.tp, "up": cfg.up, "dp": cfg.dp, "world": world, "preset": cfg.preset,
            "model": cfg.model, "dtype": cfg.dtype}


def main(argv: list[str] | None = None) -> int:
    """``python -m commfuse.train`` (e.g. under ``torchrun``), the same flags as the CLI."""
    parser = argparse.ArgumentParser(prog="commfuse train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    rc = run(parser.parse_args(argv))
    if rc == 0 and dist.is_initialized():  # after a failure, tearing down could wait on the dead
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""What a training run reports: progress lines, the summary, exposed communication, and the
peak FLOP/s that MFU is measured against (`commfuse.train.loop`)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


class Steps(list):
    """A run's per-step metrics (a list of dicts) with its ``summary`` (medians, exposed
    communication) attached, so the one value a rank returns carries both (it pickles across
    `commfuse.testbed.spawn.run_local`'s processes)."""

    def __init__(self, steps=(), summary: dict | None = None):
        super().__init__(steps)
        self.summary = summary if summary is not None else {}


def measure_matmul_flops(n: int = 512, seconds: float = 0.3, dtype=torch.float32,
                         device="cpu") -> float:
    """FLOP/s of a dense n x n matmul on this process's threads or GPU (the MFU denominator):
    the fastest of the rounds run in ``seconds`` (one matmul on CPU, 50 queued on a GPU), as
    other processes' time slices on a shared core only ever slow a round down."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    cuda = torch.device(device).type == "cuda"
    sync, per = (torch.cuda.synchronize, 50) if cuda else ((lambda: None), 1)
    a @ b
    sync()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(per):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - t0) / per)
    return 2 * n ** 3 / best


def progress(metrics: list[dict], steps: int) -> None:
    """One line per tenth of the run (a \\r-updated line in between on a terminal); the loss is
    this step's and the mean since the last printed line (one batch is noisy)."""
    m, every = metrics[-1], max(1, steps // 10)
    window = [x["loss"] for x in metrics[-((m["step"] - 1) % every + 1):]]
    line = (f"step {m['step']:>4}/{steps}  loss {m['loss']:.4f} "
            f"(avg {sum(window) / len(window):.4f})  {m['tokens_per_s']:7.0f} tok/s  "
            f"MFU {100 * m['mfu']:5.1f}%  {m['step_s'] * 1e3:6.1f} ms/step")
    if m.get("experts"):  # MoE: the busiest expert over the mean, the worst layer
        line += f"  experts max/mean {max(e['imbalance'] for e in m['experts']):.2f}"
    for name, v in m.get("moe", {}).items():  # router loss terms, dropped fraction
        line += f"  {name} {v:.4g}"
    last = m["step"] % every == 0 or m["step"] == steps
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if last else "", flush=True)
    elif last or m["step"] == 1:
        print(line, flush=True)


def report(s: dict) -> None:
    if "median_step_s" not in s:
        return
    exposed = ("not measured" if s["exposed_comm_s"] is None else
               f"{s['exposed_comm_s'] * 1e3:.1f} ms of {s['fwd_bwd_s'] * 1e3:.1f} ms fwd+bwd "
               f"(compute alone {s['compute_only_s'] * 1e3:.1f} ms)")
    print(f"done: final loss {s['final_loss']:.4f}; median step {s['median_step_s'] * 1e3:.1f} ms,"
          f" {s['median_tokens_per_s']:.0f} tok/s, MFU {100 * s['median_mfu']:.1f}%; "
          f"exposed communication: {exposed}", flush=True)


def exposed(pmodel, tokens, targets, iters: int) -> dict:
    """Median fwd+bwd+grad sync minus the same fwd+bwd in compute_only mode, interleaved.

    The normal step ends when `sync_grads` has waited for the gradient buckets the backward
    posted (`commfuse.parallel.grad_sync`), so what they did not hide counts as exposed. In
    compute_only mode every fused op, the vocabulary-parallel embedding and loss move nothing
    and the backward posts no bucket, so no sync is waited for."""
    from commfuse.runtime import modes

    normal, alone = [], []
    torch.set_flush_denormal(True)  # compute_only buffers hold garbage; keep it off slow paths
    for _ in range(iters):
        for bucket, ctx in ((normal, None), (alone, "compute_only")):
            dist.barrier()
            t0 = time.perf_counter()
            if ctx is None:
                pmodel.loss(tokens, targets).backward()
                pmodel.sync_grads()
            else:
                with modes.mode(ctx):
                    pmodel.loss(tokens, targets).backward()
            bucket.append(time.perf_counter() - t0)
            pmodel.zero_grad(set_to_none=True)
    t_all, t_alone = statistics.median(normal), statistics.median(alone)
    return {"exposed_comm_s": max(0.0, t_all - t_alone), "fwd_bwd_s": t_all,
            "compute_only_s": t_alone}


def finish(cfg, rank: int, world: int, metrics: list[dict], summary: dict,
           show: bool) -> Steps:
    """End a run: the medians over the steady steps (the first step warms up) added to
    ``summary``, printed (``show``) and, on rank 0, written with the config and every step to
    ``cfg.metrics_json``; returns ``metrics`` with ``summary`` attached."""
    if metrics:
        steady = metrics[1:] or metrics
        med = lambda key: statistics.median(m[key] for m in steady)
        summary.update(median_step_s=med("step_s"), final_loss=metrics[-1]["loss"],
                       median_tokens_per_s=med("tokens_per_s"), median_mfu=med("mfu"))
    if show:
        report(summary)
    if rank == 0 and cfg.metrics_json:
        Path(cfg.metrics_json).write_text(json.dumps(
            {"config": dataclasses.asdict(cfg), "world": world, "steps": metrics,
             "summary": summary}, indent=1))
    return Steps(metrics, summary)

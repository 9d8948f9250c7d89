"""Compute alone of query-split attention against row-parallel attention, interleaved in one run:
the criterion "the slices together cost what one causal attention costs" (issue 17), measured
so that the two layers see the same spell of the machine. ``commfuse bench layer`` runs each
workload's cells one after the other, so its ``compute qs / row`` sets two medians taken
minutes apart against each other.

    commfuse launch --nproc 2 --no-emulate -- python scripts/qsplit_compute.py \\
        --seq 2048,4096,8192 --d-model 512,1024 --pass forward,both --iters 10

No link is emulated: ``compute_only`` moves no bytes. ``--pass both`` is one cell, forward
+backward, unlike ``commfuse bench``'s ``--pass both`` (both kinds of cell).

Each cell builds `commfuse.bench.workloads` ``attn_row`` and ``attn_qsplit`` (the bench's own
layers, float32) and times one step of each per iteration in ``compute_only`` mode (no
transfers), alternating which goes first, after a barrier; a step's time is the slowest
rank's. Rank 0 prints one markdown row per cell: the medians, their ratio, the ratio's range
over iterations (each iteration's query-split over its row-parallel step), and the page faults
per step of each (minor faults, medians over the iterations, the slowest rank's), since fresh
memory is what told the two apart before the launcher fixed the allocator (docs/design.md, "The
allocator").
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from commfuse.bench import workloads
from commfuse.runtime import modes

LAYERS = ("attn_row", "attn_qsplit")
HEADER = ("| D | seq | pass | row compute ms | qs compute ms | qs / row | per iteration | "
          "faults per step: row, qs |\n|---|---|---|---:|---:|---:|---|---|")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(step, method: str, backward: bool) -> tuple[float, int]:
    """(seconds, page faults) of one step on this rank, after a barrier."""
    dist.barrier()
    f0, t0 = _faults(), time.perf_counter()
    step(method, {}, backward)
    return time.perf_counter() - t0, _faults() - f0


def slowest(values: list[float]) -> list[float]:
    """Each entry's maximum over ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def cell(seq: int, d: int, backward: bool, iters: int, warmup: int, method: str) -> dict:
    """Medians and per-iteration ratios of one cell (every rank returns the same)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    steps = [workloads.build(n, world, rank, seq, d, torch.float32) for n in LAYERS]
    times: list[list[float]] = [[], []]
    faults: list[list[float]] = [[], []]
    with modes.mode("compute_only"):
        for it in range(warmup + iters):
            order = (0, 1) if it % 2 == 0 else (1, 0)
            got = {i: timed(steps[i], method, backward) for i in order}
            t = slowest([got[0][0], got[1][0], got[0][1], got[1][1]])
            if it >= warmup:
                for i in (0, 1):
                    times[i].append(t[i])
                    faults[i].append(t[2 + i])
    ratios = [q / r for r, q in zip(*times)]
    return dict(row=statistics.median(times[0]), qs=statistics.median(times[1]),
                lo=min(ratios), hi=max(ratios),
                faults=(statistics.median(faults[0]), statistics.median(faults[1])))


def row(d: int, seq: int, backward: bool, r: dict) -> str:
    """One markdown row of the table."""
    return (f"| {d} | {seq} | {'forward+backward' if backward else 'forward'} | "
            f"{r['row'] * 1e3:.1f} | {r['qs'] * 1e3:.1f} | {r['qs'] / r['row']:.3f} | "
            f"{r['lo']:.3f}-{r['hi']:.3f} | {r['faults'][0]:.0f}, {r['faults'][1]:.0f} |")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _passes(text: str) -> list[bool]:
    choices = {"forward": False, "both": True}
    if any(p not in choices for p in text.split(",")):
        raise argparse.ArgumentTypeError(f"--pass takes forward and/or both, got {text!r}")
    return [choices[p] for p in text.split(",")]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=_ints, default=[2048, 4096, 8192], help="sequence lengths")
    p.add_argument("--d-model", type=_ints, default=[512, 1024], help="model widths")
    p.add_argument("--pass", dest="passes", type=_passes, default=[False, True],
                   help="forward and/or both (forward+backward)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per cell")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--method", default="commfuse", help="the fused ops' method")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        print(HEADER, flush=True)
    for d in args.d_model:
        for seq in args.seq:
            for backward in args.passes:
                r = cell(seq, d, backward, args.iters, args.warmup, args.method)
                if dist.get_rank() == 0:
                    print(row(d, seq, backward, r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

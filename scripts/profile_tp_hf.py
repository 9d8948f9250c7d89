r"""Where a training step's time goes under each variant of scripts/bench_tp_hf.py.

    commfuse launch --nproc 2 --link 1gbit --gso-kib 256 -- python scripts/profile_tp_hf.py \
        --model qwen3.5 --hidden 1024 --heads 8 --kv-heads 2 --ffn 2816 --seq 1024 --batch 1 \
        --loss-parallel --variants auto,none,compute-only --steps 3 --png out/qwen35.png

It takes bench_tp_hf.py's flags (the model, its sizes, ``--variants``, ``--steps``,
``--warmup``). Each variant runs its steps back to back, under a `commfuse.trace.Tracer`. Per
variant, rank 0 prints each rank's median over the steps of:
- the forward, the backward and the optimizer step;
- inside them, the time in commfuse's fused ops (whole calls, transfers included) and, of
  that, the time spent waiting on transfers;
- the rest of the step (outside the fused ops): attention, the linear-attention and Mamba
  kernels, norms, the optimizer, the plan's own collectives.
Compared with ``compute-only`` (no transfers), this tells the slowdown of the ops' compute
beside transfers from the waits.

``--png FILE`` draws the last step of every variant as a Gantt chart; ``--trace FILE`` writes
it as a Chrome trace (open it in ui.perfetto.dev). For ratios between variants, use
bench_tp_hf.py, which interleaves their steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

import bench_tp_hf
from commfuse.runtime import modes
from commfuse.trace import Panel, Span, Tracer, write_gantt, write_trace

PHASES = ("forward", "backward", "optimizer")


def step_spans(model, opt, ids, mode: str, rank: int) -> list[Span]:
    """One training step's spans: the phases on the "step" track, then the executor's."""
    tracer = Tracer(rank)
    dist.barrier()
    times = [time.perf_counter()]
    with modes.mode(mode, tracer=tracer):
        loss = model(ids, labels=ids).loss
        times.append(time.perf_counter())
        loss.backward()
        times.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter())
    phases = [Span(rank, "step", p, a, b) for p, a, b in zip(PHASES, times, times[1:])]
    return phases + tracer.spans


def breakdown(spans: list[Span]) -> dict[str, float]:
    """Seconds per phase, and in each the fused ops' time, their waits and the rest."""
    out = {}
    for p in (s for s in spans if s.kind == "step"):
        def inside(kind, p=p):
            return sum(s.end - s.start for s in spans
                       if s.kind == kind and p.start <= s.start and s.end <= p.end)
        ops = inside("op")
        out.update({p.label: p.end - p.start, f"{p.label} ops": ops,
                    f"{p.label} waits": inside("wait"), f"{p.label} rest": p.end - p.start - ops})
    return out


def run(rank: int, world: int, a, extra) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse.ops.auto import use_hardware
    torch.set_num_threads(a.threads)
    mesh = init_device_mesh("cpu", (world,))
    _, line = use_hardware(a.hardware, torch.zeros(()), mesh.get_group())
    ids = torch.randint(a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    rows, panels, last = {}, [], []
    for v in a.variants:
        if rank == 0:
            print(f"{v}: {a.warmup} + {a.steps} steps", flush=True)
        model = bench_tp_hf.make(v, a, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        mode = "compute_only" if v == "compute-only" else "normal"
        steps = [step_spans(model, opt, ids, mode, rank) for _ in range(a.warmup + a.steps)]
        mine = [breakdown(s) for s in steps[a.warmup:]]
        gathered = [None] * world
        dist.all_gather_object(gathered, ({k: statistics.median(d[k] for d in mine)
                                           for k in mine[0]}, steps[-1]))
        rows[v] = [g[0] for g in gathered]
        spans = [s for g in gathered for s in g[1]]
        panels.append(Panel(v, spans, origin=min(s.start for s in spans)))
        last += [dataclasses.replace(s, label=f"{v}: {s.label}") for s in spans]
        del model, opt
    if rank:
        return
    print(line)
    print(f"{bench_tp_hf.describe(a)}; batch {a.batch} x seq {a.seq}; TP {world}; median of "
          f"{a.steps} steps after {a.warmup}, ms")
    cols = [("fwd", "forward"), ("ops", "forward ops"), ("waits", "forward waits"),
            ("bwd", "backward"), ("ops", "backward ops"), ("waits", "backward waits"),
            ("opt", "optimizer")]
    print(f"{'variant':14}{'rank':>5}{'step':>8}" + "".join(f"{h:>8}" for h, _ in cols)
          + f"{'rest':>8}")
    for v, per_rank in rows.items():
        for r, d in enumerate(per_rank):
            step, rest = (sum(d[f"{p}{part}"] for p in PHASES) for part in ("", " rest"))
            print(f"{v:14}{r:5}{1e3 * step:8.0f}" + "".join(f"{1e3 * d[k]:8.0f}" for _, k in cols)
                  + f"{1e3 * rest:8.0f}")
    if extra.png:
        write_gantt(panels, extra.png, title=bench_tp_hf.describe(a), max_ranks=None)
        print(f"wrote {extra.png}")
    if extra.trace:
        write_trace(last, extra.trace)
        print(f"wrote {extra.trace}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--png", default=None, metavar="FILE",
                   help="the last step of every variant as a Gantt chart")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="the same as a Chrome trace JSON")
    extra, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        p.print_help()
    bench_tp_hf.start(run, bench_tp_hf.parse(rest), extra)


if __name__ == "__main__":
    main()

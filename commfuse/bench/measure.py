"""Timing on the ranks: every method interleaved, after warm-up, in one run.

For one workload at one size, each iteration times, in an order rotated every iteration:
- each method's step (``T``);
- each method's *compute alone*: the same partitioned GEMMs and copies, no transfers
  (executor mode ``compute_only``), ``C``;
- *communication alone*: the bytes of method ``none``'s collectives (as P2P transfers, the
  bytes every P2P schedule moves too), replayed with no compute;
- the *testbed limit*: those same collectives launched first, then ``none``'s compute run
  with no dependency on them, then waited: what this testbed allows (docs/design.md).
`measure_together` interleaves several workloads of one size in the same way. A step's time is
the slowest rank's; medians and the 10th-90th percentile spread over iterations are reported,
and each iteration's time (``samples_ms``, in iteration order: two methods' i-th samples ran
within one iteration, for paired ratios on a noisy machine). One more iteration per method is
traced for the timeline.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from commfuse.bench import workloads
from commfuse.runtime import executor, modes
from commfuse.schedule import VARIANTS
from commfuse.trace import Tracer


def _limit_fn(step, backward: bool):
    """The testbed limit: ``none``'s collectives on scratch buffers beside ``none``'s compute."""
    with modes.mode("record") as recorded:
        step("none", {}, backward)
    transport = executor.make_transport(dist.group.WORLD, torch.device("cpu"), None)
    calls = [(kind, torch.zeros(out, dtype=dtype), torch.zeros(inp, dtype=dtype), tag, parts)
             for kind, out, inp, dtype, tag, parts in recorded]

    def launch_all():
        return [transport.launch(*call, **parts) for *call, parts in calls]

    def comm_alone():
        for w in launch_all():
            transport.wait(w)

    def limit():
        works = launch_all()  # the same bytes, with no dependency on the compute
        with modes.mode("compute_only"):
            step("none", {}, backward)
        for w in works:
            transport.wait(w)
    return comm_alone, limit


def measure(name: str, seq: int, d: int, dtype: torch.dtype, backward: bool, iters: int,
            warmup: int, variants: list[str], trace: bool, say=print,
            ffn: int | None = None) -> dict | None:
    """Run on every rank; returns the results on rank 0 (None elsewhere). ``ffn``: the MLP
    hidden width (`workloads.build`)."""
    got = measure_together([name], seq, d, dtype, backward, iters, warmup, variants, trace,
                           say, ffn)
    return got[0] if got is not None else None


def measure_together(names: list[str], seq: int, d: int, dtype: torch.dtype, backward: bool,
                     iters: int, warmup: int, variants: list[str], trace: bool, say=print,
                     ffn: int | None = None, moe=None) -> list[dict] | None:
    """`measure` for several workloads of one size at once: every iteration times each
    workload's methods, compute alone, communication alone and limit, all in one rotated
    order, so a ratio between two workloads compares the same spell of the machine, as a
    ratio between two methods always does. Every workload's buffers are held at once. Returns
    one result per workload, in ``names`` order, on rank 0 (None elsewhere). ``moe``: the
    MoE workloads' `commfuse.bench.moe.MoEOptions`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fns, steps = {}, {}
    for name in names:
        step = steps[name] = workloads.build(name, world, rank, seq, d, dtype, ffn, moe)
        comm_alone, limit = _limit_fn(step, backward)
        for label in variants:
            method, opts = VARIANTS[label]
            fns[(name, "step", label)] = (lambda s=step, m=method, o=opts: s(m, o, backward))
            fns[(name, "compute", label)] = (lambda s=step, m=method, o=opts:
                                             _compute_only(s, m, o, backward))
        fns[(name, "comm", "-")] = comm_alone
        fns[(name, "limit", "-")] = limit
    keys = list(fns)
    for _ in range(warmup):
        for k in keys:
            fns[k]()
    times = {k: [] for k in keys}
    what = "+".join(names)
    for it in range(iters):
        shift = it % len(keys)
        for k in keys[shift:] + keys[:shift]:  # interleaved, order rotated
            dist.barrier()
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
        if rank == 0 and (it + 1) % max(1, iters // 4) == 0:
            say(f"  {what} seq {seq}: iteration {it + 1}/{iters}")
    spans = {n: _trace(steps[n], variants, backward, rank) if trace else [] for n in names}
    gathered = [None] * world
    dist.all_gather_object(gathered, (times, spans))
    if rank != 0:
        return None
    return [_summarise(n, seq, d, dtype, backward, variants,
                       [({k[1:]: v for k, v in t.items() if k[0] == n}, sp[n])
                        for t, sp in gathered],
                       ffn or (d if n in workloads.MOE else 4 * d))
            for n in names]


def _compute_only(step, method, opts, backward):
    with modes.mode("compute_only"):
        step(method, opts, backward)


def _trace(step, variants, backward, rank: int) -> list:
    """One traced iteration per method: the executor's spans and a "step" span per method."""
    spans = []
    for label in variants:
        method, opts = VARIANTS[label]
        tracer = Tracer(rank)
        dist.barrier()
        t0 = time.perf_counter()
        with modes.mode("normal", tracer):
            step(method, opts, backward)
        tracer.add("step", label, t0, time.perf_counter())
        spans += tracer.spans
    return spans


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]
    return {"median_ms": 1e3 * statistics.median(xs), "p10_ms": 1e3 * q(0.1), "p90_ms": 1e3 * q(0.9),
            "p99_ms": 1e3 * q(0.99)}


def _summarise(name, seq, d, dtype, backward, variants, gathered, ffn) -> dict:
    per_rank = [t for t, _ in gathered]
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(len(per_rank[0][k]))]
               for k in per_rank[0]}
    comm = _stats(slowest[("comm", "-")])["median_ms"]
    lim = _stats(slowest[("limit", "-")])["median_ms"]
    t_none = _stats(slowest[("step", "none")])["median_ms"] if "none" in variants else None
    rows = []
    for label in variants:
        st, c = _stats(slowest[("step", label)]), _stats(slowest[("compute", label)])["median_ms"]
        t = st["median_ms"]
        row = {"method": label, **st, "compute_ms": c, "exposed_ms": t - c,
               "samples_ms": [1e3 * x for x in slowest[("step", label)]]}
        if t_none is not None:
            row["vs_none"] = t / t_none
            row["hidden"] = _frac(t_none - t, t_none - c)
            row["of_limit"] = _frac(t_none - t, t_none - lim)
        rows.append(row)
    return {"workload": name, "seq": seq, "d_model": d, "ffn": ffn, "dtype": str(dtype)[6:],
            "pass": "forward+backward" if backward else "forward", "world": len(gathered),
            "comm_alone_ms": comm, "limit_ms": lim, "methods": rows,
            "spans": [s for _, spans in gathered for s in spans]}


def _frac(num: float, den: float) -> float | None:
    return num / den if den > 1e-9 else None

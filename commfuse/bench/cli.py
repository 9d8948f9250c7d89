"""``commfuse bench``: parse, launch the ranks (emulated cluster or loopback), measure, report."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys

import torch

from commfuse.bench import measure, report, workloads
from commfuse.bench import moe as bench_moe
from commfuse.ops.auto import add_hardware_flag, use_hardware
from commfuse.runtime.probe import fitted_fields
from commfuse.runtime.gloo import duplex
from commfuse.schedule import VARIANTS

WORKER_ENV = "COMMFUSE_BENCH_WORKER"


KINDS = {"op": "the four fused ops (and, named with --workloads, the MoE dispatch and combine)",
         "layer": "the TPSP MLP, TP attention (row-parallel Flash-RS and query-split) and the "
                  "Ulysses attention block (and, named with --workloads, the MoE layer)"}


def add_arguments(p: argparse.ArgumentParser, kind: str) -> None:
    """The flags of ``commfuse bench op`` / ``commfuse bench layer`` (``kind``)."""
    from commfuse.testbed import launch as cluster

    p.set_defaults(kind=kind)
    p.add_argument("--workloads", help="comma-separated subset (ops: " + ",".join(workloads.OPS) +
                   "; layers: " + ",".join(workloads.LAYERS) + "; MoE, only when named: " +
                   ",".join(workloads.MOE) + "); default all of the kind but MoE")
    p.add_argument("--seq", default="2048",
                   help="sequence length(s), comma-separated for a sweep (batch folded in); "
                        "divisible by --nproc (default 2048)")
    p.add_argument("--d-model", type=int, default=1024, help="model width (default 1024)")
    p.add_argument("--ffn", type=int, default=None,
                   help="MLP hidden width F (default 4 x --d-model): ag_matmul is [S, D] @ "
                        "[D, F/W], matmul_rs [S, F/W] @ [F/W, D], and the mlp layer; divisible "
                        "by --nproc. MoE workloads: each expert's hidden width (default "
                        "--d-model)")
    p.add_argument("--experts", type=int, default=8,
                   help="MoE workloads: experts in all, divisible by --nproc (default 8)")
    p.add_argument("--top-k", type=int, default=2,
                   help="MoE workloads: experts per token (default 2)")
    p.add_argument("--routing", default="balanced,zipf",
                   help="MoE workloads: comma-separated routings, each a row: balanced (even "
                        "expert load) or zipf (expert popularity ~ 1/i^--zipf-s), seeded, the "
                        "same rows for every method (default balanced,zipf)")
    p.add_argument("--zipf-s", type=float, default=1.2,
                   help="MoE workloads: the Zipf exponent of --routing zipf (default 1.2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--pass", dest="passes", choices=["forward", "backward", "both"], default="both",
                   help="forward, forward+backward, or both (default both)")
    p.add_argument("--methods", default=None,
                   help="comma-separated, from " + ",".join(VARIANTS) + " (default all; MoE "
                        "workloads run " + ",".join(bench_moe.METHODS) + ", default " +
                        ",".join(bench_moe.DEFAULT_METHODS) + ")")
    p.add_argument("--iters", type=int, default=15, help="timed iterations per method (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1: "
                   "one core per rank, see docs/design.md)")
    p.add_argument("--no-trace", dest="trace", action="store_false",
                   help="skip the Chrome/Perfetto trace of one iteration per method")
    add_hardware_flag(p)
    p.add_argument("--probe-each", action="store_true",
                   help="with --hardware measured: fit the model again before each workload, "
                        "not once at start, so that predictions and auto's choices follow a "
                        "machine whose speed drifts over a long run (each result records its "
                        "fit; ~3 s a workload)")
    p.add_argument("--interleave-workloads", action="store_true",
                   help="time all the workloads of one size in the same iterations, as the "
                        "methods of one workload always are, so a ratio between workloads "
                        "(query-split over row-parallel) compares the same spell of a noisy "
                        "machine; holds every workload's buffers at once")
    p.add_argument("--out", default="bench-out", help="folder for JSON, PNG and traces "
                   "(default ./bench-out)")
    cluster.add_cluster_options(p)
    p.set_defaults(run=run)


def _list(text: str, allowed, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"commfuse bench: unknown {what} {bad or text!r}; choose from {list(allowed)}")
    return items


def run(args) -> int:
    names = _list(args.workloads, workloads.OPS + workloads.LAYERS + workloads.MOE,
                  "workload") if args.workloads \
        else list(workloads.OPS if args.kind == "op" else workloads.LAYERS)
    moe = [n for n in names if n in workloads.MOE]
    if args.methods is None:
        args.methods = ",".join(bench_moe.DEFAULT_METHODS if len(moe) == len(names)
                                else VARIANTS)
    _list(args.methods, VARIANTS, "method")
    if moe:
        _list(args.methods, bench_moe.METHODS, "method for the MoE workloads")
        try:
            args.moe = [bench_moe.MoEOptions(args.experts, args.top_k, r, args.zipf_s)
                        for r in _list(args.routing, ("balanced", "zipf"), "routing")]
        except ValueError as e:
            raise SystemExit(f"commfuse bench: {e}")
        if args.experts % args.nproc:
            raise SystemExit(f"commfuse bench: --experts ({args.experts}) must be divisible "
                             f"by --nproc ({args.nproc})")
    seqs = [int(s) for s in args.seq.split(",")]
    if args.ffn is not None and (args.ffn <= 0 or args.ffn % args.nproc):
        raise SystemExit(f"commfuse bench: --ffn must be > 0 and divisible by --nproc "
                         f"({args.nproc}), got {args.ffn}")
    if args.probe_each and args.hardware != "measured":
        raise SystemExit(f"commfuse bench: --probe-each fits the model at each workload, which "
                         f"--hardware {args.hardware} (a preset, used as it is) rules out")
    if any(s % args.nproc for s in seqs):
        raise SystemExit(f"commfuse bench: every --seq must be divisible by --nproc ({args.nproc})")
    split_d = [n for n in names if n in ("matmul_a2a", "a2a_matmul", "ulysses")]
    if split_d and args.d_model % args.nproc:
        raise SystemExit(f"commfuse bench: --d-model ({args.d_model}) must be divisible by "
                         f"--nproc ({args.nproc}) for {', '.join(split_d)} (the all-to-all "
                         f"splits the width), or leave them out with --workloads")
    if "RANK" in os.environ:  # a rank: launched by us, by `commfuse launch` or by torchrun
        return _worker(args, names, seqs)
    from commfuse.testbed import launch as cluster

    try:
        spec = cluster.spec_from_args(args)
    except ValueError as e:
        raise SystemExit(f"commfuse bench: {e}")
    argv = [sys.executable, "-m", "commfuse.cli", "bench", *sys.argv[2:]]
    os.environ[WORKER_ENV] = "1"
    try:
        return cluster.launch(spec, argv, timeout=args.timeout)
    except cluster.EmulationUnavailable as e:
        print(f"[bench] {e}\n[bench] FALLING BACK TO LOOPBACK: transfers cost no wire time, so "
              f"the overlap figures mean little")
        return cluster.launch(dataclasses.replace(spec, emulate=False, straggler_rank=None,
                                              straggler_link=None, straggler_cpu=None), argv,
                              timeout=args.timeout)


def _predict_moe(result: dict, world: int, hw, dtype, moe) -> None:
    """The simulator's time beside each method of an MoE result (same table, same hardware
    model as auto's), the routing it ran, and for the layer the dedup's saving."""
    from commfuse.schedule import VARIANTS as V

    r = result
    r["routing"] = moe.label()
    if r["workload"] == "moe":
        r["dedup"] = bench_moe.dedup_saving(world, r["seq"], r["d_model"], dtype.itemsize, moe)
    for row in r["methods"]:
        row["predicted_ms"] = 1e3 * bench_moe.predict(
            r["workload"], world, r["seq"], r["d_model"], r["ffn"], dtype.itemsize,
            r["pass"] != "forward", V[row["method"]], hw, moe)


def _worker(args, names: list[str], seqs: list[int]) -> int:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    duplex()  # one connection per direction between two ranks (commfuse.runtime.gloo)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    passes = {"forward": [False], "backward": [True], "both": [False, True]}[args.passes]
    say = lambda msg: print(msg, flush=True) if rank == 0 else None
    link = os.environ.get("COMMFUSE_LINK", "loopback (not emulated)")
    say(f"[bench] {world} ranks, link {link}, {args.threads} thread(s) per rank, "
        f"{args.iters} iterations after {args.warmup} warm-up, methods interleaved")
    hw, line = use_hardware(args.hardware, torch.empty(0, dtype=dtype))
    say(f"[bench] {line}")
    results, done = [], 0  # (results on rank 0 only; done on every rank)
    cells = [([n], seq, bw) for n in names for seq in seqs for bw in passes]
    if args.interleave_workloads:
        cells = [(names, seq, bw) for seq in seqs for bw in passes]
    # an MoE workload runs once per routing
    cells = [(g, seq, bw, o) for g, seq, bw in cells for o in (
        getattr(args, "moe", [None]) if any(n in workloads.MOE for n in g) else [None])]
    for group, seq, backward, moe in cells:
        group = [n for n in group if not (backward and n in workloads.FORWARD_ONLY)]
        if not group:
            continue
        say(f"[bench] {'+'.join(group)} seq {seq} "
            f"{'forward+backward' if backward else 'forward'} ({done + 1} of about {len(cells)})")
        if args.probe_each and done:  # (`run` took --hardware measured; every rank)
            hw, line = use_hardware(args.hardware, torch.empty(0, dtype=dtype))
            say(f"[bench] {line}")
        got = measure.measure_together(group, seq, args.d_model, dtype, backward, args.iters,
                                       args.warmup, args.methods.split(","), args.trace, say,
                                       args.ffn, moe)
        done += 1
        for r in got or []:
            if r["workload"] in workloads.MOE:
                _predict_moe(r, world, hw, dtype, moe)
            say(report.table(r) + "\n")
            results.append({**r, "hardware": line, "fitted": fitted_fields(hw)})
    if rank == 0:
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                "torch": torch.__version__, "link": link, "world": world,
                "threads_per_rank": args.threads, "hardware": line,
                **fitted_fields(hw), "command": "commfuse bench " + " ".join(sys.argv[2:]),
                "title": f"commfuse bench {args.kind}: {world} ranks, link {link}"}
        stem = f"{args.kind}-{world}r"
        for p in report.save(results, meta, args.out, stem):
            say(f"[bench] wrote {p}")
    dist.destroy_process_group()
    return 0

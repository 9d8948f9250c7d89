"""``commfuse bench train``: the whole training step, every method, on the emulated cluster.

For every preset x layout x method (`commfuse.bench.train_table.configs`) it runs
``commfuse train`` as its own job, on tp*up*dp ranks under ``commfuse launch`` (each rank in
its own network namespace with shaped links; root needed, else loopback) or, with --local,
as local ranks over loopback. Each run's rank 0 writes its metrics JSON to OUT; a run whose
JSON is there already is not run again (resumable; --fresh reruns). After every run the
markdown document is rewritten with the rows done so far, and each configuration's row is
printed as its last repeat completes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from commfuse.bench import train_table
from commfuse.bench.train_table import Config

DESCRIPTION = __doc__.split("\n\n", 1)[1].replace("``", "").replace("`", "") + """
Per configuration the table has: median step (ms), the ratio to method none of the same preset
and layout, tokens/s, MFU, exposed communication (fwd+bwd minus the same in compute-only mode),
the simulator's predicted step (commfuse.sim.step.simulate_train_step on --hw: GEMMs, transfers,
attention, elementwise work, loss and optimizer, the current training step)
and the step's limit (the same compute and bytes with no dependency), and whether the losses
equal none's step for step (same seed and data: they should, up to summation order).

Use one rank per core for overlap figures: more ranks than cores time-share the CPU, and the
ratios then measure scheduling as much as overlap (the document says how the ranks ran)."""

EPILOG = """\
examples:
  commfuse bench train                                   # tiny,small x tp2,up2,dp2 x 4 methods
  commfuse bench train --presets tiny --layouts tp2 --methods none,commfuse --steps 5
  commfuse bench train --layouts tp4,up4,dp4,tp2xdp2 --presets tiny   # 4 ranks
  commfuse bench train --local --presets tiny --layouts tp2 --steps 2   # loopback smoke run"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--presets", default="tiny,small", help="comma-separated model presets (default tiny,small)")
    a("--layouts", default="tp2,up2,dp2",
      help="comma-separated layouts, each tpN, upN, dpN or a product like tp2xdp2; a layout "
           "runs on tp*up*dp ranks (default tp2,up2,dp2)")
    a("--methods", default="none,sliced,commfuse,auto",
      help="comma-separated method labels (none, sliced, decompose, commfuse, commfuse-m2, "
           "commfuse-m4, commfuse-direct, auto), each optionally ending in -qs or -noqs: "
           "query-split TP attention forced on (commfuse train --query-split) or off "
           "(--no-query-split; by default auto's cost model chooses, the other methods run "
           "row-parallel); TP layouts only; then optionally @MODEL: commfuse train "
           "--hardware MODEL (e.g. auto@cpu-testbed: the preset, not the model fitted at "
           "start). none is the baseline of the ratios "
           "(default none,sliced,commfuse,auto)")
    a("--prefetch", default=None,
      help="comma-separated commfuse train --prefetch values, each run as its own layout "
           "(dp2-pf1, dp2-pf0), e.g. 1,0 to compare ZeRO-3 prefetch on and off in one run; "
           "Nr: N with --reduce-in-op (default: not passed, the train default)")
    a("--regather-prefetch", choices=("on", "off", "both"), default="on",
      help="the backward's cross-op prefetch of AG->GEMM re-gathers (commfuse.ops.prefetch): "
           "on (commfuse train's default), off (--no-regather-prefetch) or both, each method "
           "run both ways side by side (default on)")
    a("--steps", type=int, default=20, help="training steps per run (default 20; the first "
                                            "is warm-up, excluded from the medians)")
    a("--batch-size", type=int, default=8, help="global batch in sequences (default 8)")
    a("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    a("--dtype", choices=("float32", "bfloat16"), default="float32")
    a("--repeats", type=int, default=1,
      help="runs per configuration, the methods interleaved (all configurations once, then "
           "again, each layout's methods in an order that rotates every repeat: a method's "
           "place in the order moves its step by several percent on a shared machine); the "
           "table shows medians over repeats (default 1)")
    a("--hw", default="measured", help="the simulator's hardware model for the predicted "
                                       "step and limit: measured (the CPU preset with its "
                                       "compute fitted here at start, as commfuse train's "
                                       "--hardware measured) or a preset name (default "
                                       "measured)")
    a("--out", default="bench-out/train",
      help="folder of the per-run metrics JSON and logs (default bench-out/train)")
    a("--doc", default=None, help="markdown file to write (default "
                                  "<--out>/<today>-training.md)")
    a("--fresh", action="store_true", help="rerun configurations whose JSON exists in --out")
    a("--loss-tol", type=float, default=1e-4,
      help="relative difference under which a step's loss equals none's (default 1e-4)")
    a("--local", action="store_true",
      help="no commfuse launch: commfuse train spawns its ranks locally over loopback")
    a("--link", default="1gbit", help="commfuse launch: every rank's bandwidth (default 1gbit)")
    a("--delay", default="50us", help="commfuse launch: one-way latency (default 50us)")
    a("--gso-kib", type=int, default=64,
      help="commfuse launch: the links' TCP super-packet size, 64..512 KiB (default 64, the "
           "kernel's own; see commfuse launch --help)")
    a("--no-emulate", dest="emulate", action="store_false",
      help="commfuse launch on plain loopback (automatic without root)")
    a("--pin", action=argparse.BooleanOptionalAction, default=None,
      help="commfuse launch: pin rank i to core i %% ncores (default: when ranks <= cores)")
    a("--run-timeout", type=float, default=3600, help="seconds before a run is killed "
                                                      "(default 3600)")
    p.set_defaults(run=run)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run(args) -> int:
    from commfuse.models.config import PRESETS

    try:
        pf = _split(args.prefetch) if args.prefetch else [None]
        if any(not x.rstrip("r").isdigit() for x in pf if x):
            raise ValueError(f"--prefetch takes N or Nr values (N >= 0), got {args.prefetch!r}")
        cfgs = train_table.configs(_split(args.presets), _split(args.layouts),
                                   _split(args.methods), pf,
                                   {"on": (True,), "off": (False,), "both": (True, False)}
                                   [args.regather_prefetch])
    except ValueError as e:
        raise SystemExit(f"commfuse bench train: {e}") from e
    bad = [p for p in _split(args.presets) if p not in PRESETS]
    if bad or args.steps < 2 or args.repeats < 1:
        raise SystemExit(f"commfuse bench train: unknown preset(s) {bad} (choose from "
                         f"{sorted(PRESETS)})" if bad else
                         "commfuse bench train: --steps must be >= 2 and --repeats >= 1")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    doc = Path(args.doc or out / f"{datetime.date.today().isoformat()}-training.md")
    if args.hw == "measured":  # the model the runs choose on (each fits its own at start)
        import torch

        from commfuse.ops.auto import use_hardware

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank runs: one core, one thread (commfuse launch)
        try:
            args.hw, line = use_hardware("measured", torch.empty(0))
        finally:
            torch.set_num_threads(threads)
        say(f"[bench train] {line}")
    meta = _meta(args)
    predictions = {c: predict(c, args) for c in cfgs}
    runs: dict[Config, list[dict]] = {c: [] for c in cfgs}
    total, failed = len(cfgs) * args.repeats, []
    say(f"[bench train] {total} runs ({len(cfgs)} configurations x {args.repeats}), "
        f"{meta['run']}; per-run JSON and logs in {out}, document {doc}")
    for rep in range(args.repeats):
        for i, c in enumerate(train_table.rotated(cfgs, rep)):
            n = rep * len(cfgs) + i + 1
            path = out / f"{c.key}-r{rep + 1}.json"
            label = f"{c.preset} {c.layout} {c.label}"
            metrics = None if args.fresh else _load(path)
            if metrics is None:
                say(f"[bench train] run {n}/{total}: {label} on {c.world} ranks "
                    f"(repeat {rep + 1}/{args.repeats}) ...")
                t0 = time.monotonic()
                rc = run_one(c, args, path, out / "logs" / f"{c.key}-r{rep + 1}.log")
                metrics = _load(path)
                if rc != 0 or metrics is None:
                    failed.append(label)
                    say(f"[bench train] run {n}/{total}: {label} FAILED (exit {rc}); log: "
                        f"{out / 'logs' / (c.key + f'-r{rep + 1}.log')}")
                    continue
                took = f"{time.monotonic() - t0:.0f} s"
            else:
                took = "from an earlier run"
            runs[c].append(metrics)
            r = train_table.run_row(metrics)
            exposed = "-" if r["exposed_s"] is None else f"{1e3 * r['exposed_s']:.1f} ms"
            say(f"[bench train] run {n}/{total}: {label}: median step {1e3 * r['step_s']:.1f} "
                f"ms, {r['tokens_per_s']:,.0f} tok/s, exposed {exposed} ({took})")
            rows = train_table.aggregate(runs, predictions, args.loss_tol)
            doc.parent.mkdir(parents=True, exist_ok=True)
            doc.write_text(train_table.markdown(rows, meta))
            if rep == args.repeats - 1:
                row = next(x for x in rows if x["config"] == c)
                say(train_table.row_line(row))
    say(f"[bench train] wrote {doc}" + (f"; {len(failed)} run(s) failed: {', '.join(failed)}"
                                        if failed else ""))
    return 1 if failed else 0


def run_one(c: Config, args, path: Path, log: Path) -> int:
    """One ``commfuse train`` of configuration ``c``, its output to ``log``; the exit code."""
    flags = c.train_flags() + ["--steps", str(args.steps), "--batch-size", str(args.batch_size),
                               "--seq-len", str(args.seq_len), "--dtype", args.dtype,
                               "--metrics-json", str(path.resolve())]
    train = [sys.executable, "-m", "commfuse.train", *flags]
    if args.local:
        argv = train + ["--nproc", str(c.world)]
    else:
        argv = [sys.executable, "-m", "commfuse.cli", "launch", "--nproc", str(c.world),
                "--link", args.link, "--delay", args.delay, "--gso-kib", str(args.gso_kib),
                *([] if args.emulate else ["--no-emulate"]),
                *([] if args.pin is None else ["--pin" if args.pin else "--no-pin"]),
                "--timeout", str(args.run_timeout), "--", *train]
    path.unlink(missing_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n")
        f.flush()
        try:
            return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout + 60).returncode
        except subprocess.TimeoutExpired:
            return 124


def predict(c: Config, args) -> tuple[float | None, float | None]:
    """(predicted step s, limit s) of ``c`` on the simulator; (None, None) where the model
    does not apply (it says why in the log)."""
    from commfuse.models.config import LlamaConfig
    from commfuse.parallel.config import ParallelDims
    from commfuse.schedule import VARIANTS
    from commfuse.sim.choose import STEP_OVERHEAD_S
    from commfuse.sim.step.timing import OpTimer
    from commfuse.sim.step.train import simulate_train_step
    from commfuse.sim.step.work import TrainSetup

    method, opts = VARIANTS[c.method]
    try:
        model = LlamaConfig.preset(c.preset, max_seq_len=args.seq_len)
        dims = ParallelDims(c.tp, c.up, c.dp, method, opts, world_size=c.world,
                            regather_prefetch=1 if c.regather else 0,
                            query_split=c.query_split)
        dtype_bytes = 4 if args.dtype == "float32" else 2
        hw = c.hardware if c.hardware not in (None, "measured") else args.hw  # "@PRESET"
        # as commfuse train runs: no activation checkpointing, parameters, gradients and
        # AdamW in the training dtype, DP as commfuse.parallel.data (no FSDP2 prefetch)
        setup = TrainSetup(ac="none", fsdp=False, param_bytes=dtype_bytes,
                           grad_bytes=dtype_bytes, optimizer_bytes=2 * dtype_bytes)
        r = simulate_train_step(model, dims, hw, seq=args.seq_len, batch=args.batch_size,
                                micro_batch=args.batch_size // c.dp, dtype_bytes=dtype_bytes,
                                setup=setup, timer=OpTimer(dtype_bytes, STEP_OVERHEAD_S["cpu"]))
        # the limit: the ops' limit, plus the work the whole step adds (none of it overlaps)
        return r.step_s, r.step_s - (r.base.step_s - r.base.limit_s)
    except ValueError as e:
        say(f"[bench train] no prediction for {c.key}: {e}")
        return None, None


def _load(path: Path) -> dict | None:
    try:
        m = json.loads(path.read_text())
        return m if "median_step_s" in m.get("summary", {}) else None
    except (OSError, ValueError):
        return None


def _meta(args) -> dict:
    import torch

    from commfuse.sim.step.ops import StepModel

    root = hasattr(os, "geteuid") and os.geteuid() == 0
    emulated = not args.local and args.emulate and root
    run = ("local ranks over loopback (commfuse train --nproc), no shaping" if args.local else
           f"commfuse launch, every rank in its own network namespace, {args.link} links, "
           f"delay {args.delay}, {args.gso_kib} KiB TCP super-packets" if emulated else
           "commfuse launch on loopback (no root or --no-emulate), no shaping")
    return {"title": f"commfuse bench train: {args.presets} x {args.layouts}",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
            "torch": torch.__version__, "link": f"{args.link} delay {args.delay}"
            if emulated else "loopback", "run": run + f"; {args.steps} steps of "
            f"{args.batch_size} x {args.seq_len} tokens, {args.dtype}, {args.repeats} repeat(s)",
            "command": "commfuse bench train " + " ".join(sys.argv[3:] if sys.argv[1:3] ==
                                                          ["bench", "train"] else sys.argv[1:]),
            "hw": args.hw if isinstance(args.hw, str) else
            f"cpu-testbed fitted here (GEMM {args.hw.gemm_flops / 1e9:.1f} GFLOP/s)",
            "step_model": StepModel().describe(), "loss_tol": args.loss_tol,
            "exposed_iters": 3}


def say(msg: str) -> None:
    print(msg, flush=True)

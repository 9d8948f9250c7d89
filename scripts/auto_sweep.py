"""`method="auto"` across GEMM shapes: the K x N sweep of docs/benchmarks/simulator.md.

Both ops of the TPSP MLP pair on 2 emulated ranks (1 Gbit/s, fp32, forward), for every K of ``--k``,
N of ``--n`` and S of ``--seq``: AG->GEMM gathers A [S/2, K] to [S, K] and multiplies by
B [K, N]; GEMM->RS multiplies [S, N] @ [N, K] and reduce-scatters the [S, K] product (so K is
the width that moves, N the other GEMM dim; ``commfuse bench op --d-model K --ffn 2N``).

``run`` benchmarks the cells (one ``commfuse bench op`` per (K, N), both seqs and ops in it,
each wrapped in ``--wrap``, e.g. the CPU lock); ``table`` reads the JSON back and prints, per
cell: every method's measured median beside the simulator's prediction on the
``cpu-testbed`` preset, the method auto ran (the same deterministic choice `commfuse.ops.auto`
makes, recomputed here), auto against the best fixed method (the ratio of medians, and paired:
the median over iterations of the two in the same iteration, from bench's ``samples_ms``;
and held out: the best chosen on half the iterations, both measured on the other half),
the fraction of the testbed limit reached (as medians, and held out in the same way), and
the simulator's worst error. The summary also gives one schedule measured twice: auto over
its pick run as the fixed method, the same schedule, so the spread of that ratio is what the
run can resolve.

    python scripts/auto_sweep.py run --out out/auto-sweep --k 1024,2048,4096 --n 1024,2048,4096
    python scripts/auto_sweep.py table out/auto-sweep/k????-n????/op-2r.json

``table --run-rate`` instead splits the simulator's error: the rate each workload's compute
ran at (from its compute alone, in the same iterations) against the probe's, and the model
at the run's rate (`at_run_rate`): whether a miss is the model's or the machine running the
workload slower than the probe saw.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from commfuse.schedule import VARIANTS
from commfuse.sim import choose
from commfuse.sim.calibrate import DTYPE_BYTES, op_shape
from commfuse.sim.hardware import preset
from commfuse.sim.simulate import simulate_op
from commfuse.runtime.probe import from_fields

METHODS = ("none", "sliced", "commfuse-m1", "commfuse-m2", "commfuse-m4", "commfuse-m8", "auto")
SHORT = {"commfuse-m1": "m1", "commfuse-m2": "m2", "commfuse-m4": "m4", "commfuse-m8": "m8"}


def run(a) -> None:
    for k in a.k:
        for n in a.n:
            out = Path(a.out) / f"k{k}-n{n}{a.tag}"
            if (out / "op-2r.json").exists() and not a.again:
                print(f"[auto_sweep] {out} done, skipped", flush=True)
                continue
            cmd = [*shlex.split(a.wrap), "timeout", str(a.timeout), sys.executable, "-m",
                   "commfuse.cli", "bench", "op", "--workloads", "ag_matmul,matmul_rs",
                   "--seq", ",".join(map(str, a.seq)), "--d-model", str(k), "--ffn", str(2 * n),
                   "--pass", "forward", "--methods", ",".join(METHODS), "--iters", str(a.iters),
                   "--warmup", str(a.warmup), "--nproc", "2", "--link", "1gbit", "--no-trace",
                   "--out", str(out), *(["--probe-each"] if a.probe_each else [])]
            print("[auto_sweep] " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)


def _name(method: str, opts: dict) -> str:
    """The bench label of auto's (method, options), or its own name where no label matches."""
    opts = {"topology": "ring", **opts} if method in ("commfuse", "decompose") else opts
    if method == "commfuse":
        opts = {"splits": 1, **opts}
    for label, (m, o) in VARIANTS.items():
        o = {"splits": 1, **o} if m == "commfuse" else o
        if label not in ("commfuse", "auto") and (m, o) == (method, opts):
            return label
    return " ".join([method] + [f"{k}={v}" for k, v in sorted(opts.items())])


def file_hardware(meta: dict, name: str):
    """The hardware model a result's predictions use: preset ``name``, or for "measured" the
    ``cpu-testbed`` preset with what the run's ``--hardware measured`` fitted (``meta``: the
    file's meta, fitted at start, or the result's own fit; `commfuse.runtime.probe.from_fields`;
    the preset's values where the file predates them)."""
    return preset(name) if name != "measured" else from_fields(meta, preset("cpu-testbed"))


def _results(paths, hw):
    """(path, result, the hardware its predictions use, its op shape) per result of each
    file: its own fit (bench --probe-each), else the run's (``hw`` as in `cells`)."""
    for path in paths:
        data = json.load(open(path))
        for r in data["results"]:
            file_hw = file_hardware(r.get("fitted", data["meta"]), hw) if isinstance(hw, str) \
                else hw
            yield path, r, file_hw, op_shape(r)


def _predict(r: dict, shape, hw, label: str, pick):
    """The simulated run of bench label ``label`` (``pick``'s method for auto) on ``hw``."""
    method, opts = pick[:2] if label == "auto" else VARIANTS[label]
    return simulate_op(r["workload"], method, r["world"], shape, DTYPE_BYTES[r["dtype"]], hw,
                       timeline=False, **opts)


def _fastest(r: dict, shape, hw):
    return choose.choice(r["workload"], shape, r["world"], DTYPE_BYTES[r["dtype"]], hw,
                         choose.STEP_OVERHEAD_S["cpu"])


def _k_n(r: dict, shape) -> tuple[int, int]:
    """The sweep's K (the width that moves) and N (the other GEMM dim) of an op shape."""
    return (shape[1], shape[2]) if r["workload"] == "ag_matmul" else (shape[2], shape[1])


def cells(paths, hw) -> list[dict]:
    """One row per (file, op, S, K, N): measured and predicted ms per method, auto's choice.
    ``hw``: a preset name or "measured" (`file_hardware`), or a `Hardware`."""
    rows = []
    for path, r, file_hw, shape in _results(paths, hw):
        K, N = _k_n(r, shape)
        med = {m["method"]: m for m in r["methods"]}
        pick = _fastest(r, shape, file_hw)
        name = _name(*pick[:2])
        ran = med.get(name)  # auto's pick, measured as that fixed method (None: not measured)
        pred = {m: 1e3 * _predict(r, shape, file_hw, m, pick).total_s for m in med}
        fixed = [m for m in med if m != "auto"]
        best = min(fixed, key=lambda m: med[m]["median_ms"])
        lim = [med[m].get("of_limit") or 0.0 for m in fixed]
        rows.append({"file": str(path), "op": r["workload"], "S": r["seq"], "K": K, "N": N,
                     "comm_ms": r["comm_alone_ms"], "compute_ms": med["none"]["compute_ms"],
                     "limit_ms": r["limit_ms"], "pick": name,
                     "measured": {m: v["median_ms"] for m, v in med.items()},
                     "spread": {m: (v["p10_ms"], v["p90_ms"]) for m, v in med.items()},
                     "predicted": pred, "best": best,
                     "ratio": med["auto"]["median_ms"] / med[best]["median_ms"],
                     "pick_ratio": ran and ran["median_ms"] / med[best]["median_ms"],
                     "same": ran and med["auto"]["median_ms"] / ran["median_ms"],
                     "paired": _paired(med["auto"], med[best]),
                     "held_out": _held_out(med, fixed),
                     "held_out_limit": _held_out_limit(med, fixed, r["limit_ms"]),
                     "auto_of_limit": med["auto"].get("of_limit") or 0.0,
                     "pick_of_limit": ran and (ran.get("of_limit") or 0.0),
                     "best_of_limit": max(lim),
                     "worst_err": max(abs(pred[m] / med[m]["median_ms"] - 1) for m in med)})
    return sorted(rows, key=lambda c: (c["op"], c["S"], c["K"], c["N"], c["file"]))


def _paired(a: dict, b: dict) -> float | None:
    """The median over iterations of a's time over b's in the same iteration (``samples_ms``;
    None for bench files without it): a slow spell of a shared machine slows both
    alike, where the ratio of medians can set one method's slow samples against the other's
    fast ones."""
    if "samples_ms" not in a or "samples_ms" not in b:
        return None
    return statistics.median(x / y for x, y in zip(a["samples_ms"], b["samples_ms"]))


def _halves(med: dict, fixed: list[str]) -> list | None:
    """The two ways round of a held-out comparison: (``t``, best), with the best fixed method
    chosen on one half of the iterations (even or odd) and ``t(m)`` method m's median on the
    other: the best of several noisy medians is biased low, and a median not used to choose
    is not (None without ``samples_ms``, or with fewer than 4 iterations)."""
    if any("samples_ms" not in med[m] for m in [*fixed, "auto"]) or \
            len(med["auto"]["samples_ms"]) < 4:
        return None
    half = lambda m, i: statistics.median(med[m]["samples_ms"][i::2])
    return [(lambda m, i=1 - c: half(m, i), min(fixed, key=lambda m, c=c: half(m, c)))
            for c in (0, 1)]


def _held_out(med: dict, fixed: list[str]) -> float | None:
    """auto over the best fixed method, held out (`_halves`), the mean of the two ways round."""
    halves = _halves(med, fixed)
    return halves and statistics.fmean(t("auto") / t(best) for t, best in halves)


def _held_out_limit(med: dict, fixed: list[str], limit_ms: float) -> tuple | None:
    """(auto's, the best fixed method's) fraction of the testbed limit reached (bench's
    ``of_limit``: of the time from ``none`` down to the limit, how much a method saves),
    held out (`_halves`: ``none`` too measured on the half not chosen on), the mean of the two
    ways round. The largest of several noisy fractions is biased high as the smallest time
    is biased low; the limit is the file's median."""
    halves = _halves(med, fixed) if "none" in med else None
    frac = lambda t, m: (t("none") - t(m)) / (t("none") - limit_ms) \
        if t("none") - limit_ms > 1e-9 else 0.0
    if not halves:
        return None
    return (statistics.fmean(frac(t, "auto") for t, _ in halves),
            statistics.fmean(frac(t, best) for t, best in halves))


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pair(x) -> str:
    return "-" if x is None else f"{x[0]:.2f}, {x[1]:.2f}"


def markdown(rows: list[dict]) -> str:
    out = ["| op | S | K | N | comm / GEMM | auto ran | auto ms | best fixed | best ms | "
           "auto / best | paired | held out | its pick, fixed / best | "
           "of limit: auto, best fixed | held out | sim worst error |",
           "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in rows:
        ok = c["ratio"] <= 1.05 and (c["auto_of_limit"] >= 0.9 or c["best_of_limit"] < 0.9)
        out.append(f"| {c['op']} | {c['S']} | {c['K']} | {c['N']} | "
                   f"{c['comm_ms'] / c['compute_ms']:.2f} | {c['pick']} | "
                   f"{c['measured']['auto']:.1f} | {c['best']} | "
                   f"{c['measured'][c['best']]:.1f} | {'' if ok else '**'}{c['ratio']:.3f}"
                   f"{'' if ok else '**'} | {_ratio(c['paired'])} | {_ratio(c['held_out'])} | "
                   f"{_ratio(c['pick_ratio'])} | "
                   f"{c['auto_of_limit']:.2f}, {c['best_of_limit']:.2f} | "
                   f"{_pair(c['held_out_limit'])} | {100 * c['worst_err']:.0f} % |")
    n = len(rows)
    within = sum(c["ratio"] <= 1.05 for c in rows)
    need = [c for c in rows if c["best_of_limit"] >= 0.9]
    lim_ok = sum(c["auto_of_limit"] >= 0.9 for c in need)
    pick_lim = [c["pick_of_limit"] for c in need if c["pick_of_limit"] is not None]
    sim_ok = sum(c["worst_err"] <= 0.15 for c in rows)
    picks = [c["pick_ratio"] for c in rows if c["pick_ratio"] is not None]
    same = [c["same"] for c in rows if c["same"] is not None]
    paired = [c["paired"] for c in rows if c["paired"] is not None]
    held = [c["held_out"] for c in rows if c["held_out"] is not None]
    held_need = [c["held_out_limit"] for c in rows
                 if c["held_out_limit"] and c["held_out_limit"][1] >= 0.9]
    out.append(f"\nauto within 5 % of the best fixed method in {within} of {n} cells (worst "
               f"{max(c['ratio'] for c in rows):.3f}); at >= 0.90 of the testbed limit in "
               f"{lim_ok} of the {len(need)} cells where a fixed method reaches 0.90; simulator "
               f"within 15 % for every method in {sim_ok} of {n} cells (worst "
               f"{100 * max(c['worst_err'] for c in rows):.0f} %). auto's pick, measured as "
               f"the same fixed method, within 5 % of the best in {sum(x <= 1.05 for x in picks)}"
               f" of {len(picks)} (worst {max(picks, default=float('nan')):.3f}), and at >= "
               f"0.90 of the limit in {sum(x >= 0.9 for x in pick_lim)} of {len(pick_lim)}."
               + (f" One schedule measured twice (auto over its pick run as the fixed method): "
                  f"{min(same):.3f}-{max(same):.3f}, beyond 5 % in "
                  f"{sum(abs(x - 1) > 0.05 for x in same)} of {len(same)} cells." if same else "")
               + (f" Paired per iteration, auto within 5 % of the best in "
                  f"{sum(x <= 1.05 for x in paired)} of {len(paired)} (worst "
                  f"{max(paired):.3f})." if paired else "")
               + (f" With the best chosen on half the iterations and measured on the other "
                  f"half, within 5 % in {sum(x <= 1.05 for x in held)} of {len(held)} (worst "
                  f"{max(held):.3f}; median {statistics.median(held):.3f})." if held else "")
               + (f" Held out so, at >= 0.90 of the limit in "
                  f"{sum(a >= 0.9 for a, _ in held_need)} of the {len(held_need)} cells where "
                  f"the best fixed method reaches 0.90." if held else "")
               + "\n")
    methods = [m for m in METHODS if all(m in c["measured"] for c in rows)]
    out.append("Measured median (predicted) ms per method; auto's prediction is its pick's:\n")
    out.append("| op | S | K | N | " + " | ".join(SHORT.get(m, m) for m in methods) + " |")
    out.append("|---|---:|---:|---:|" + "---:|" * len(methods))
    for c in rows:
        out.append(f"| {c['op']} | {c['S']} | {c['K']} | {c['N']} | " + " | ".join(
            f"{c['measured'][m]:.0f} ({c['predicted'][m]:.0f})" for m in methods) + " |")
    return "\n".join(out)


def fair_share(paths, hw) -> str:
    """The AG->GEMM cells predicted with and without ``fifo_per_peer`` (else the same
    hardware): errors of splits 2, 4, 8, each model's pick and that pick's measured time over
    the best fixed method's ("-" where the pick was not measured)."""
    fifo, fair = cells(paths, hw.with_(fifo_per_peer=True)), cells(paths, hw.with_(
        fifo_per_peer=False))
    out = ["| S | K | N | fifo: m2, m4, m8 error | fifo pick | fair share: m2, m4, m8 error | "
           "fair pick | its / best |", "|---:|---:|---:|---|---|---|---|---:|"]
    err = lambda c: ", ".join(f"{100 * (c['predicted'][m] / c['measured'][m] - 1):+.0f} %"
                              for m in ("commfuse-m2", "commfuse-m4", "commfuse-m8"))
    for a, b in zip(fifo, fair):
        if a["op"] == "ag_matmul":
            t = b["measured"].get(b["pick"])
            ratio = f"{t / b['measured'][b['best']]:.3f}" if t else "-"
            out.append(f"| {a['S']} | {a['K']} | {a['N']} | {err(a)} | {a['pick']} | {err(b)} "
                       f"| {b['pick']} | {ratio} |")
    return "\n".join(out)


def at_run_rate(paths, hw) -> str:
    """The simulator's error split in two, per cell: the probe's rate against the rate the
    workload's compute ran at, and the model at that rate. The GEMM peak of each result's
    model is scaled by the median over methods of predicted over measured compute alone (the
    same partitioned work with no transfers, in the same interleaved iterations: one method's
    median alone is as noisy as its step); every method is then predicted again (step, and
    compute alone).
    A diagnostic of where the error lies, not a prediction: the rate comes from the
    measurement it is compared with."""
    rows = []
    for path, r, base, shape in _results(paths, hw):
        med = {m["method"]: m for m in r["methods"]}
        pick = _fastest(r, shape, base)
        probe = {m: _predict(r, shape, base, m, pick) for m in med}
        rate = statistics.median(1e3 * probe[m].compute_s / med[m]["compute_ms"] for m in med)
        run_hw = base.with_(gemm_flops=base.gemm_flops * rate)
        pick = _fastest(r, shape, run_hw)
        run = {m: _predict(r, shape, run_hw, m, pick) for m in med}
        err = lambda sims, field, key: max(abs(1e3 * getattr(sims[m], field) / med[m][key] - 1)
                                           for m in med)
        best = min((m for m in med if m != "auto"), key=lambda m: med[m]["median_ms"])
        name = _name(*pick[:2])
        K, N = _k_n(r, shape)
        rows.append({"key": (r["workload"], r["seq"], K, N, str(path)), "rate": rate,
                     "probe": err(probe, "total_s", "median_ms"),
                     "run": err(run, "total_s", "median_ms"),
                     "compute": err(run, "compute_s", "compute_ms"), "pick": name,
                     "its": (med[name]["median_ms"] / med[best]["median_ms"] if name in med
                             else None)})
    rows.sort(key=lambda c: c["key"])
    out = ["| op | S | K | N | compute: run's rate / probe's | sim worst error | at the "
           "run's rate | compute alone, worst error at the run's rate | pick at the run's "
           "rate | its / best |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for c in rows:
        op, S, K, N, _ = c["key"]
        out.append(f"| {op} | {S} | {K} | {N} | {c['rate']:.2f} | {100 * c['probe']:.0f} % | "
                   f"{100 * c['run']:.0f} % | {100 * c['compute']:.0f} % | {c['pick']} | "
                   f"{_ratio(c['its'])} |")
    within = lambda field: sum(c[field] <= 0.15 for c in rows)
    its = [c["its"] for c in rows if c["its"] is not None]
    out.append(f"\nSimulator within 15 % for every method in {within('probe')} of {len(rows)} "
               f"cells on the probe's rate, {within('run')} at the run's rate (worst "
               f"{100 * max(c['run'] for c in rows):.0f} %); compute alone within 15 % in "
               f"{within('compute')}. The pick at the run's rate, measured as that fixed "
               f"method, within 5 % of the best in {sum(x <= 1.05 for x in its)} of {len(its)}.")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="benchmark the cells (one bench op per K, N)")
    ints = lambda s: [int(x) for x in s.split(",")]
    r.add_argument("--out", required=True, help="folder: one k{K}-n{N} subfolder per cell")
    r.add_argument("--seq", type=ints, default=[2048, 4096])
    r.add_argument("--k", type=ints, default=[1024, 2048, 4096], help="values of K")
    r.add_argument("--n", type=ints, default=[1024, 2048, 4096], help="values of N")
    r.add_argument("--iters", type=int, default=5)
    r.add_argument("--warmup", type=int, default=1)
    r.add_argument("--timeout", type=int, default=1500, help="seconds per bench op")
    r.add_argument("--wrap", default="", help="command prefix, e.g. /work/bin/cpu-bench")
    r.add_argument("--again", action="store_true", help="rerun cells already measured")
    r.add_argument("--probe-each", action="store_true", help="bench's --probe-each: the model "
                   "fitted again before each workload, each result predicted on its own fit")
    r.add_argument("--tag", default="", help="suffix of the cell folders, e.g. --tag=-s4096 "
                   "(a second run of cells already measured)")
    t = sub.add_parser("table", help="markdown tables from the JSON files")
    t.add_argument("paths", nargs="+")
    t.add_argument("--hw", default="measured", help="hardware model of the predictions and of "
                   "auto's pick: a preset, or measured (cpu-testbed with what each run "
                   "fitted at start; the preset for files from before the probe)")
    t.add_argument("--json", help="also write the rows here")
    t.add_argument("--seq", type=ints, help="only these S")
    t.add_argument("--fair-share", action="store_true", help="instead: the AG->GEMM cells "
                   "predicted with and without Hardware.fifo_per_peer")
    t.add_argument("--run-rate", action="store_true", help="instead: the simulator's error "
                   "split into the probe's rate against the run's and the model at the "
                   "run's rate (a diagnostic: the rate comes from the measurement)")
    a = p.parse_args(argv)
    if a.cmd == "run":
        return run(a)
    if a.run_rate:
        return print(at_run_rate(a.paths, a.hw))
    if a.fair_share:
        return print(fair_share(a.paths, preset("cpu-testbed" if a.hw == "measured" else a.hw)))
    rows = [c for c in cells(a.paths, a.hw) if not a.seq or c["S"] in a.seq]
    print(markdown(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""`method="auto"` against the default method and every fixed method, pooled over repeated
`commfuse bench op` runs of the same workloads (docs/benchmarks/simulator.md, "auto against
the default").

    python scripts/auto_default.py RUN1/op-2r.json RUN2/op-2r.json RUN3/op-2r.json

The default is ``commfuse`` with no ``splits`` (bench label ``commfuse``): the m
`commfuse.sim.choose.best_splits` picks. Per workload (op, S, K, N), over every run given:
auto's pick and the default's m in each run (recomputed from the model that run fitted at
start, as the ranks made them: `commfuse.sim.choose.choice`, `best_splits`); auto over the
default paired per iteration (the median, 10th and 90th percentile over every run's
iterations of auto's time over the default's in the same iteration: the spread against which
"never worse than the default" is read); each method's median over all runs' iterations
pooled, beside the simulator's prediction on each run's model (the median over runs); and
the fraction of the testbed limit that auto, the default and the best fixed method reach,
from the pooled medians.
"""

from __future__ import annotations

import argparse
import json
import statistics

from commfuse.runtime.probe import from_fields
from commfuse.schedule import VARIANTS
from commfuse.sim import choose
from commfuse.sim.calibrate import DTYPE_BYTES, op_shape
from commfuse.sim.hardware import preset
from commfuse.sim.simulate import simulate_op


def _label(method: str, opts: dict) -> str:
    """A short name of auto's (method, options): m2, decompose, none, direct, ..."""
    if method == "commfuse":
        return "direct" if opts.get("topology") == "direct" else f"m{opts.get('splits', 1)}"
    return method


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cells(paths) -> list[dict]:
    """One row per workload found in ``paths`` (results of the same workloads, one file per
    run): the figures of the module doc."""
    runs: dict[tuple, list] = {}
    for path in paths:
        for r in json.load(open(path))["results"]:
            shape = op_shape(r)
            runs.setdefault((r["workload"], r["seq"], *shape), []).append(r)
    rows = []
    for (op, seq, M, K, N), rs in sorted(runs.items()):
        picks, splits, pred, ratios = [], [], {}, []
        samples: dict[str, list] = {}
        for r in rs:
            hw = from_fields(r["fitted"], preset("cpu-testbed"))
            args = (op, (M, K, N), r["world"], DTYPE_BYTES[r["dtype"]], hw,
                    choose.STEP_OVERHEAD_S["cpu"])
            pick, m = choose.choice(*args)[:2], choose.best_splits(*args)
            picks.append(_label(*pick))
            splits.append(m)
            med = {x["method"]: x for x in r["methods"]}
            for label in med:
                method, opts = pick if label == "auto" else \
                    ("commfuse", {"splits": m}) if label == "commfuse" else VARIANTS[label]
                t = simulate_op(op, method, r["world"], (M, K, N), DTYPE_BYTES[r["dtype"]], hw,
                                timeline=False, **opts).total_s
                pred.setdefault(label, []).append(1e3 * t)
                samples.setdefault(label, []).extend(med[label]["samples_ms"])
            ratios += [a / d for a, d in zip(med["auto"]["samples_ms"],
                                             med["commfuse"]["samples_ms"])]
        pooled = {k: statistics.median(v) for k, v in samples.items()}
        limit = statistics.median(r["limit_ms"] for r in rs)
        of = lambda t: (pooled["none"] - t) / (pooled["none"] - limit)
        fixed = [k for k in pooled if k not in ("auto", "commfuse")]
        best = min(fixed, key=pooled.get)
        comm = statistics.median(r["comm_alone_ms"] for r in rs)
        compute = statistics.median(next(x["compute_ms"] for x in r["methods"]
                                         if x["method"] == "none") for r in rs)
        rows.append({"op": op, "S": seq, "K": K if op == "ag_matmul" else N,
                     "N": N if op == "ag_matmul" else K, "runs": len(rs),
                     "comm_per_gemm": comm / compute, "auto_ran": picks, "default_m": splits,
                     "paired": statistics.median(ratios), "p10": _quantile(ratios, 0.1),
                     "p90": _quantile(ratios, 0.9), "pooled": pooled,
                     "predicted": {k: statistics.median(v) for k, v in pred.items()},
                     "best": best, "of_limit": {k: of(pooled[k]) for k in
                                                ("auto", "commfuse", best)}})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| op | S | K | N | comm / GEMM | auto ran | default m | auto / default, paired "
           "(p10-p90) | of limit: auto, default, best fixed (which) |",
           "|---|---:|---:|---:|---:|---|---|---:|---|"]
    for c in rows:
        lim = c["of_limit"]
        out.append(f"| {c['op']} | {c['S']} | {c['K']} | {c['N']} | "
                   f"{c['comm_per_gemm']:.2f} | {', '.join(c['auto_ran'])} | "
                   f"{', '.join(map(str, c['default_m']))} | {c['paired']:.3f} "
                   f"({c['p10']:.2f}-{c['p90']:.2f}) | {lim['auto']:.2f}, {lim['commfuse']:.2f}, "
                   f"{lim[c['best']]:.2f} ({c['best']}) |")
    methods = [m for m in rows[0]["pooled"] if all(m in c["pooled"] for c in rows)]
    out += ["", "Pooled median ms (the simulator's, median over runs):", "",
            "| op | S | K | N | " + " | ".join(methods) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(methods)]
    for c in rows:
        out.append(f"| {c['op']} | {c['S']} | {c['K']} | {c['N']} | " + " | ".join(
            f"{c['pooled'][m]:.0f} ({c['predicted'][m]:.0f})" for m in methods) + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="commfuse bench op JSON, one per run")
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    rows = cells(a.paths)
    print(markdown(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

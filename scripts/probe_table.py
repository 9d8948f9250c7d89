"""The table of docs/sim-vs-measured.md, "The model's compute, fitted at start": for each op
of `commfuse bench op` JSON files (runs of the same cells), the measured median per commfuse
m (ratio to `none` of the same run), and the cost model's prediction per m on the
`cpu-testbed` preset and on it with the GEMM rate fitted (`commfuse.sim.probe.fit`) to
GFLOPS, with each model's pick of m (`commfuse.sim.choose.best_splits`). GFLOPS,SMALL also
fits m0 to the probe's small GEMM rate SMALL (1/8 the rows).

    python scripts/probe_table.py 158 docs/benchmarks/2026-12-01-probe/ops-*.json
    python scripts/probe_table.py 152,117 docs/benchmarks/2026-12-01-probe/ops-*.json
"""
import json
import sys

from commfuse.sim import choose
from commfuse.sim.choose import STEP_OVERHEAD_S, best_splits
from commfuse.sim.hardware import preset
from commfuse.sim.ops import simulate_op
from commfuse.sim.probe import Rates, fit

MS = (1, 2, 4, 8)


def predicted(hw, op, shape):
    step = STEP_OVERHEAD_S["cpu"]
    none = simulate_op(op, "none", 2, shape, 4, hw, timeline=False).total_s
    ms = [simulate_op(op, "commfuse", 2, shape, 4, hw, timeline=False, splits=m).total_s
          + step * choose.steps(op, "commfuse", 2, {"splits": m}) for m in MS]
    return [t / none for t in ms], best_splits(op, shape, 2, 4, hw, step, "ring")


def main(rates: str, paths: list[str]) -> None:
    base = preset("cpu-testbed")
    gflops, *small = (float(x) for x in rates.split(","))
    fitted = fit(base, Rates(gflops * 1e9, None, small[0] * 1e9 if small else None))
    cells: dict[tuple, list[list[float]]] = {}
    for path in paths:
        for r in json.load(open(path))["results"]:
            t = {x["method"]: x["median_ms"] for x in r["methods"]}
            local = r["ffn"] // 2
            shape = (r["seq"], r["d_model"], local) if r["workload"] == "ag_matmul" \
                else (r["seq"], local, r["d_model"])
            cells.setdefault((r["workload"], shape), []).append(
                [t[f"commfuse-m{x}"] / t["none"] for x in MS])
    print("| op | M, K, N | measured x none, m = 1 / 2 / 4 / 8 (each run) | best m | "
          f"preset: predicted, pick | fitted to {rates} GFLOP/s: predicted, pick |")
    print("|---|---|---|---|---|---|")
    for (op, shape), runs in sorted(cells.items()):
        meas = "; ".join(" / ".join(f"{x:.2f}" for x in run) for run in runs)
        mean = [sum(run[i] for run in runs) / len(runs) for i in range(len(MS))]
        best = MS[mean.index(min(mean))]
        cols = []
        for hw in (base, fitted):
            pred, pick = predicted(hw, op, shape)
            cols.append(" / ".join(f"{x:.2f}" for x in pred) + f", **m={pick}**")
        print(f"| {op} | {', '.join(map(str, shape))} | {meas} | m={best} | {cols[0]} | "
              f"{cols[1]} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

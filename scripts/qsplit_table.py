"""The table of docs/benchmarks/2026-12-01-query-split.md: measured TP attention (row-parallel
Flash-RS vs query-split) from `commfuse bench layer` JSON files, with the simulator's
prediction (`commfuse.sim.attention`) beside each, on the cpu-testbed preset with what each
run fitted at start (`commfuse.sim.probe.from_fields`; the preset for older files).

    python scripts/qsplit_table.py docs/benchmarks/2026-12-01-query-split/*/layer-2r.json
    python scripts/qsplit_table.py --bounds ...   # what query-split could reach: with nothing
                                                  # exposed, and on this testbed (its limit)
    python scripts/qsplit_table.py --pooled ...   # several runs of one grid together
"""

import json
import statistics
import sys

from commfuse.sim import simulate_ops
from commfuse.sim.attention import layer_specs
from commfuse.sim.hardware import preset
from commfuse.sim.probe import from_fields


def main(paths):
    rows, hws = {}, {}
    for path in paths:
        data = json.load(open(path))
        hw = from_fields(data["meta"], preset("cpu-testbed"))
        for r in data["results"]:
            key = (r["d_model"], r["seq"], r["pass"])
            hws[key] = hw
            for m in r["methods"]:
                rows.setdefault(key, {})[(r["workload"], m["method"])] = m
    print("| D | seq | pass | none (row) ms | row Flash-RS ms | query-split ms | compute qs / row "
          "| qs / row Flash-RS | qs / none | predicted: row, qs ms | predicted qs / row, / none |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (d, seq, pas), ms in sorted(rows.items()):
        bw = pas != "forward"
        sim = {wl: {m: simulate_ops(layer_specs(wl, m, 2, seq, d, bw), 2, 4, hws[(d, seq, pas)],
                                    timeline=False).total_s * 1e3 for m in ("none", "commfuse")}
               for wl in ("attn_row", "attn_qsplit")}
        none, row, qs = (ms[("attn_row", "none")], ms[("attn_row", "commfuse")],
                         ms[("attn_qsplit", "commfuse")])
        prow, pqs, pnone = sim["attn_row"]["commfuse"], sim["attn_qsplit"]["commfuse"], \
            sim["attn_row"]["none"]
        print(f"| {d} | {seq} | {pas} | {none['median_ms']:.1f} | {row['median_ms']:.1f} | "
              f"{qs['median_ms']:.1f} | {qs['compute_ms'] / row['compute_ms']:.3f} | "
              f"**{qs['median_ms'] / row['median_ms']:.3f}** | "
              f"**{qs['median_ms'] / none['median_ms']:.3f}** | {prow:.1f}, {pqs:.1f} | "
              f"{pqs / prow:.3f}, {pqs / pnone:.3f} |")


def bounds(paths):
    """What query-split could reach: with nothing exposed (its compute alone), and on this
    testbed (its testbed limit, bench's ``limit_ms``: ``none``'s collectives launched beside
    ``none``'s compute with no dependency, so the compute slowed by the transfers is in it),
    each over row-parallel Flash-RS's measured time and over `none`'s; and how many cells
    the issue's targets (<= 0.95 of row-parallel, <= 0.80 of none) are within reach at all."""
    rows, limits = {}, {}
    for path in paths:
        for r in json.load(open(path))["results"]:
            key = (r["d_model"], r["seq"], r["pass"])
            limits[(key, r["workload"])] = r["limit_ms"]
            for m in r["methods"]:
                rows.setdefault(key, {})[(r["workload"], m["method"])] = m
    print("| D | seq | pass | qs compute alone ms | qs exposed ms | best qs / row Flash-RS "
          "| best qs / none | qs testbed limit ms | limit / row Flash-RS | limit / none "
          "| measured qs / row, / none | qs / its limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    reach = {"row": [0, 0, 0], "none": [0, 0, 0]}  # cells: the limit allows, reached, both
    for key, ms in sorted(rows.items()):
        none, row, qs = (ms[("attn_row", "none")]["median_ms"],
                         ms[("attn_row", "commfuse")]["median_ms"],
                         ms[("attn_qsplit", "commfuse")])
        floor, lim, t = qs["compute_ms"], limits[(key, "attn_qsplit")], qs["median_ms"]
        for name, base, target in (("row", row, 0.95), ("none", none, 0.80)):
            allows, reached = lim / base <= target, t / base <= target
            reach[name][0] += allows
            reach[name][1] += reached
            reach[name][2] += allows and reached
        print(f"| {' | '.join(map(str, key))} | {floor:.1f} | {t - floor:.1f} | "
              f"{floor / row:.3f} | {floor / none:.3f} | {lim:.1f} | {lim / row:.3f} | "
              f"{lim / none:.3f} | {t / row:.3f}, {t / none:.3f} | {t / lim:.3f} |")
    say = lambda n, what: (f"{what}: query-split reached it in {reach[n][1]} of {len(rows)} "
                           f"cells; the testbed limit is within it in {reach[n][0]}, and "
                           f"query-split reached it in {reach[n][2]} of those")
    print(f"\n{say('row', '<= 0.95 of row-parallel Flash-RS')}. {say('none', '<= 0.80 of none')}.")


def pooled(paths):
    """Several runs of one grid, measured with ``--interleave-workloads`` (so each iteration
    timed both layers): per cell, the median over every iteration of every run of that
    iteration's query-split step over its row-parallel (and its `none`) step; the range of the
    runs' own median ratios; and the testbed limit and compute alone of query-split over the
    medians of row-parallel and `none`, pooled the same way (medians over runs)."""
    cells = {}
    for path in paths:
        for r in json.load(open(path))["results"]:
            c = cells.setdefault((r["d_model"], r["seq"], r["pass"]), {"runs": {}})
            run = c["runs"].setdefault(path, {})
            for m in r["methods"]:
                run[(r["workload"], m["method"])] = m
            run[("limit", r["workload"])] = r["limit_ms"]
    print("| D | seq | pass | runs | qs / row Flash-RS, paired (the runs' medians) | qs limit / row "
          "| qs / none, paired | qs compute alone / none | qs limit / none |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    reach = {"row": [0, 0], "none": [0, 0]}  # cells: the limit allows, and reached there too
    for key, c in sorted(cells.items()):
        runs = list(c["runs"].values())
        samples = lambda wl, m: [x for run in runs for x in run[(wl, m)]["samples_ms"]]
        qs, row, none = (samples("attn_qsplit", "commfuse"), samples("attn_row", "commfuse"),
                         samples("attn_row", "none"))
        by_run = [run[("attn_qsplit", "commfuse")]["median_ms"] /
                  run[("attn_row", "commfuse")]["median_ms"] for run in runs]
        q_row, q_none = med(q / r for q, r in zip(qs, row)), med(q / n for q, n in zip(qs, none))
        lim = med(run[("limit", "attn_qsplit")] for run in runs)
        comp = med(run[("attn_qsplit", "commfuse")]["compute_ms"] for run in runs)
        for name, got, bound, target in (("row", q_row, lim / med(row), 0.95),
                                         ("none", q_none, lim / med(none), 0.80)):
            reach[name][0] += bound <= target
            reach[name][1] += bound <= target and got <= target
        print(f"| {' | '.join(map(str, key))} | {len(runs)} | **{q_row:.3f}** "
              f"({min(by_run):.3f}-{max(by_run):.3f}) | {lim / med(row):.3f} | **{q_none:.3f}** "
              f"| {comp / med(none):.3f} | {lim / med(none):.3f} |")
    n = len(cells)
    print(f"\nqs <= 0.95 of row-parallel Flash-RS where the limit is within it: "
          f"{reach['row'][1]} of {reach['row'][0]} (of {n} cells); qs <= 0.80 of none where "
          f"the limit is within it: {reach['none'][1]} of {reach['none'][0]}.")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bounds"]:
        bounds(sys.argv[2:])
    elif sys.argv[1:2] == ["--pooled"]:
        pooled(sys.argv[2:])
    else:
        main(sys.argv[1:])

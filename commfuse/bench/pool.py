"""Several runs of one ``commfuse bench`` command pooled: per workload, size, pass and routing,
each method's median of the per-iteration ratio to ``none`` over every run's iterations, beside
each run's own, and the median step times. A ratio pairs the i-th samples of a run (they ran
within one iteration: the same spell of a noisy machine).

    python -m commfuse.bench.pool run1/layer-4r.json run2/layer-4r.json run3/layer-4r.json
"""

from __future__ import annotations

import json
import statistics

from commfuse.bench.report import dedup_line


def _key(r: dict) -> tuple:
    return (r["workload"], r["seq"], r["pass"], r.get("routing", ""))


def _ratios(r: dict, method: str) -> list[float]:
    """Per-iteration ratios of ``method`` to none in result ``r``."""
    rows = {m["method"]: m["samples_ms"] for m in r["methods"]}
    return [a / b for a, b in zip(rows[method], rows["none"])]


def pool(runs: list[list[dict]]) -> list[dict]:
    """One entry per (workload, seq, pass, routing) found in every run: ``methods`` with
    ``pooled`` (median ratio to none over all runs' iterations), ``per_run`` (each run's
    median ratio), ``median_ms`` (each run's median step), and the first run's result
    fields (``dedup``, ``d_model``...)."""
    out = []
    for first in runs[0]:
        same = [next((r for r in run if _key(r) == _key(first)), None) for run in runs]
        if any(r is None for r in same) or "none" not in {m["method"] for m in first["methods"]}:
            continue
        methods = []
        for m in first["methods"]:
            per = [_ratios(r, m["method"]) for r in same]
            methods.append({"method": m["method"],
                            "pooled": statistics.median([x for p in per for x in p]),
                            "per_run": [statistics.median(p) for p in per],
                            "median_ms": [next(x["median_ms"] for x in r["methods"]
                                               if x["method"] == m["method"]) for r in same]})
        out.append({**{k: v for k, v in first.items() if k != "methods"}, "methods": methods,
                    "runs": len(runs)})
    return out


def markdown(pooled: list[dict]) -> str:
    out = []
    for r in pooled:
        out.append(f"**{r['workload']}**, seq {r['seq']}, d_model {r['d_model']}, ffn {r['ffn']}"
                   f"{' (' + r['routing'] + ')' if r.get('routing') else ''}, {r['pass']}, "
                   f"{r['world']} ranks, {r['runs']} runs pooled\n")
        out.append("| method | pooled ratio to none | per run | median ms per run |")
        out.append("|---|---:|---:|---:|")
        for m in r["methods"]:
            out.append(f"| {m['method']} | {m['pooled']:.3f} | "
                       + " / ".join(f"{x:.3f}" for x in m["per_run"]) + " | "
                       + " / ".join(f"{x:.1f}" for x in m["median_ms"]) + " |")
        if r.get("dedup"):
            out += ["", dedup_line(r["dedup"])]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m commfuse.bench.pool", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN.json",
                   help="the JSON of each run of one commfuse bench command")
    runs = []
    for path in p.parse_args(argv).runs:
        with open(path) as f:
            runs.append(json.load(f)["results"])
    print(markdown(pool(runs)))


if __name__ == "__main__":
    main()

"""Readable results: a terminal table, JSON, a PNG chart, a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from commfuse.trace import Panel, write_gantt, write_trace


def _ffn(r: dict) -> str:
    """`` ffn F`` where a result's MLP width is not the default 4 x d_model; an MoE result's
    expert width and routing."""
    if r.get("routing"):
        return f" ffn {r['ffn']} ({r['routing']})"
    return f" ffn {r['ffn']}" if r.get("ffn") not in (None, 4 * r["d_model"]) else ""


def _sim(r: dict) -> bool:
    """Whether the result's rows carry the simulator's prediction (`predicted_ms`)."""
    return all("predicted_ms" in m for m in r["methods"])


def table(result: dict) -> str:
    r = result
    head = (f"{r['workload']}  seq {r['seq']}  d_model {r['d_model']}{_ffn(r)}  {r['dtype']}  {r['pass']}  "
            f"{r['world']} ranks   comm alone {r['comm_alone_ms']:.2f} ms   "
            f"testbed limit {r['limit_ms']:.2f} ms")
    cols = f"{'method':<16}{'median ms':>10}{'p10-p90':>16}{'compute':>9}{'exposed':>9}" \
           f"{'hidden':>8}{'of limit':>9}{'vs none':>9}" + (f"{'sim ms':>9}{'sim/meas':>9}"
                                                            if _sim(r) else "")
    lines = [head, cols, "-" * len(cols)]
    pct = lambda x: "   -" if x is None else f"{100 * x:5.0f}%"
    for m in r["methods"]:
        sim = f"{m['predicted_ms']:9.2f}{m['predicted_ms'] / m['median_ms']:9.2f}" \
            if _sim(r) else ""
        lines.append(f"{m['method']:<16}{m['median_ms']:10.2f}{m['p10_ms']:8.2f}-{m['p90_ms']:<7.2f}"
                     f"{m['compute_ms']:9.2f}{m['exposed_ms']:9.2f}{pct(m.get('hidden')):>8}"
                     f"{pct(m.get('of_limit')):>9}{m.get('vs_none', float('nan')):9.3f}{sim}")
    if r.get("dedup"):
        lines.append(dedup_line(r["dedup"]))
    return "\n".join(lines)


def dedup_line(dd: dict) -> str:
    """An MoE layer's off-rank all-to-all rows and bytes (one forward, all ranks) with the
    dedup and with one row per (token, expert) (`commfuse.bench.moe.dedup_saving`)."""
    return (f"dedup: {dd['rows']:,} rows / {dd['bytes'] / 2 ** 20:.1f} MiB off-rank per forward "
            f"(dispatch + combine, all ranks) against {dd['rows_plain']:,} / "
            f"{dd['bytes_plain'] / 2 ** 20:.1f} MiB one per (token, expert): "
            f"{100 * dd['saving']:.1f} % saved (uniform routing's expectation "
            f"{100 * dd['expected_saving']:.1f} %)")


def write_json(results: list[dict], meta: dict, path: str) -> None:
    slim = [{k: v for k, v in r.items() if k != "spans"} for r in results]
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": slim}, f, indent=1)


def write_png(results: list[dict], path: str, title: str) -> None:
    """Bars per method (median, spread), with compute-alone and the testbed limit marked;
    one panel per workload and size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, r in zip(axes.flat, results):
        names = [m["method"] for m in r["methods"]]
        med = [m["median_ms"] for m in r["methods"]]
        err = [[m["median_ms"] - m["p10_ms"] for m in r["methods"]],
               [m["p90_ms"] - m["median_ms"] for m in r["methods"]]]
        xs = range(len(names))
        ax.bar(xs, med, yerr=err, color="#4c72b0", capsize=3, label="step (median, p10-p90)")
        ax.scatter(xs, [m["compute_ms"] for m in r["methods"]], marker="_", s=400, color="#dd8452",
                   zorder=3, label="compute alone")
        ax.axhline(r["limit_ms"], color="#55a868", ls="--", lw=1, label="testbed limit")
        ax.set_xticks(list(xs), names, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{r['workload']} seq {r['seq']} ({r['pass']})", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(results: list[dict], meta: dict, out_dir: str, stem: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")]
    write_json(results, meta, paths[0])
    with open(paths[1], "w") as f:
        f.write(f"`{meta.get('command', '')}` ({meta.get('date', '')}, {meta.get('machine', '')}, "
                f"link {meta.get('link', '')})\n\n" + markdown(results))
    for r in results:
        if r["spans"]:
            tag = "fwd" if r["pass"] == "forward" else "fwdbwd"
            name = r["workload"] + (f"-{r['routing'].split(',')[0].split()[0]}"
                                    if r.get("routing") else "")
            p = os.path.join(out_dir, f"{stem}-{name}-{r['seq']}-{tag}.trace.json")
            write_trace(r["spans"], p)
            paths.append(p)
            try:
                write_timeline_png(r, p.replace(".trace.json", ".timeline.png"))
                paths.append(p.replace(".trace.json", ".timeline.png"))
            except ImportError:
                pass
    try:
        png = os.path.join(out_dir, f"{stem}.png")
        write_png(results, png, meta.get("title", stem))
        paths.append(png)
    except ImportError:
        print("[bench] matplotlib not installed: no PNG (pip install 'commfuse[bench]')")
    return paths


def write_timeline_png(result: dict, path: str) -> None:
    """The traced iteration of every method as a Gantt chart, one panel per method: per rank,
    compute (GEMMs, adds), transfers (post to completed wait) and waits on separate rows, from
    the rank's step start to its end (the vertical line), so overlap and tails show."""
    panels = []
    for m in result["methods"]:
        spans, ends = [], []
        for step in (s for s in result["spans"] if s.track == "step" and s.label == m["method"]):
            t0, t1 = step.start, step.end
            spans += [replace(s, start=s.start - t0, end=s.end - t0) for s in result["spans"]
                      if s.rank == step.rank and s.track != "step" and t0 <= s.start <= t1]
            ends.append(t1 - t0)
        panels.append(Panel(m["method"], spans, ends, origin=0.0))
    write_gantt(panels, path, f"{result['workload']} seq {result['seq']} ({result['pass']}): "
                "where the time goes, from each rank's step start (one traced iteration per "
                "method)", max_ranks=None)


def markdown(results: list[dict]) -> str:
    """The results as markdown tables (the tables of docs/benchmarks), one per workload and size."""
    pct = lambda x: "-" if x is None else f"{100 * x:.0f} %"
    out = []
    for r in results:
        out.append(f"**{r['workload']}**, seq {r['seq']}, d_model {r['d_model']}{_ffn(r)}, {r['dtype']}, "
                   f"{r['pass']}, {r['world']} ranks: communication alone {r['comm_alone_ms']:.1f} ms, "
                   f"testbed limit {r['limit_ms']:.1f} ms\n")
        sim = _sim(r)
        out.append("| method | median ms | p10-p90 ms | compute alone ms | exposed ms | hidden "
                   "| of limit | vs none |" + (" sim ms | sim / measured |" if sim else ""))
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if sim else ""))
        for m in r["methods"]:
            extra = (f" {m['predicted_ms']:.1f} | {m['predicted_ms'] / m['median_ms']:.2f} |"
                     if sim else "")
            out.append(f"| {m['method']} | {m['median_ms']:.1f} | {m['p10_ms']:.0f}-{m['p90_ms']:.0f} "
                       f"| {m['compute_ms']:.1f} | {m['exposed_ms']:.1f} | {pct(m.get('hidden'))} "
                       f"| {pct(m.get('of_limit'))} | {m.get('vs_none', float('nan')):.3f} |"
                       + extra)
        if r.get("dedup"):
            out += ["", dedup_line(r["dedup"])]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":  # python -m commfuse.bench.report results.json: markdown tables
    import sys

    for path in sys.argv[1:]:
        with open(path) as f:
            print(markdown(json.load(f)["results"]))

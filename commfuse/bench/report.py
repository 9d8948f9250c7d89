"""Readable results: a terminal table, JSON, a PNG chart, a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import os


def table(result: dict) -> str:
    r = result
    head = (f"{r['workload']}  seq {r['seq']}  d_model {r['d_model']}  {r['dtype']}  {r['pass']}  "
            f"{r['world']} ranks   comm alone {r['comm_alone_ms']:.2f} ms   "
            f"testbed limit {r['limit_ms']:.2f} ms")
    cols = f"{'method':<16}{'median ms':>10}{'p10-p90':>16}{'compute':>9}{'exposed':>9}" \
           f"{'hidden':>8}{'of limit':>9}{'vs none':>9}"
    lines = [head, cols, "-" * len(cols)]
    pct = lambda x: "   -" if x is None else f"{100 * x:5.0f}%"
    for m in r["methods"]:
        lines.append(f"{m['method']:<16}{m['median_ms']:10.2f}{m['p10_ms']:8.2f}-{m['p90_ms']:<7.2f}"
                     f"{m['compute_ms']:9.2f}{m['exposed_ms']:9.2f}{pct(m.get('hidden')):>8}"
                     f"{pct(m.get('of_limit')):>9}{m.get('vs_none', float('nan')):9.3f}")
    return "\n".join(lines)


def write_json(results: list[dict], meta: dict, path: str) -> None:
    slim = [{k: v for k, v in r.items() if k != "spans"} for r in results]
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": slim}, f, indent=1)


def write_trace(result: dict, path: str) -> None:
    """One traced iteration per method, per rank: ranks are processes, tracks are threads."""
    events, t_min = [], min((s[2] for spans in result["spans"] for s in spans), default=0.0)
    for rank, spans in enumerate(result["spans"]):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        tracks = sorted({s[0] for s in spans}, key=lambda t: (t != "step", t != "compute", t))
        for tid, track in enumerate(tracks):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": track}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for track, name, t0, t1 in spans:
            events.append({"ph": "X", "pid": rank, "tid": tracks.index(track), "name": name,
                           "ts": 1e6 * (t0 - t_min), "dur": 1e6 * (t1 - t0)})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


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
        if any(r["spans"]):
            tag = "fwd" if r["pass"] == "forward" else "fwdbwd"
            p = os.path.join(out_dir, f"{stem}-{r['workload']}-{r['seq']}-{tag}.trace.json")
            write_trace(r, p)
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
    """The traced iteration of every method as a Gantt chart: per rank, compute (GEMMs, adds)
    and transfers (post to completed wait) on separate rows, so overlap and tails show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m["method"] for m in result["methods"]]
    fig, axes = plt.subplots(len(methods), 1, figsize=(11, 1.35 * len(methods) + 0.6),
                             squeeze=False)
    colors = {"compute": "#4c72b0", "send": "#dd8452", "recv": "#55a868", "collective": "#c44e52",
              "wait": "#8c8c8c"}
    for ax, label in zip(axes[:, 0], methods):
        rows, ticks = [], []
        for rank, spans in enumerate(result["spans"]):
            step = next((s for s in spans if s[0] == "step" and s[1] == label), None)
            if step is None:
                continue
            t0, t1 = step[2], step[3]
            mine = [s for s in spans if s[0] != "step" and t0 <= s[2] <= t1]
            for kind in ("compute", "send", "recv", "collective", "wait"):
                bars = [(1e3 * (s[2] - t0), 1e3 * (s[3] - s[2])) for s in mine
                        if s[0].split()[0] == kind]
                if bars:
                    ax.broken_barh(bars, (len(rows) - 0.4, 0.8), color=colors[kind])
                    rows.append(kind)
                    ticks.append(f"r{rank} {kind}")
            ax.axvline(1e3 * (t1 - t0), color="k", lw=0.6)
        ax.set_yticks(range(len(ticks)), ticks, fontsize=6)
        ax.set_ylabel(label, fontsize=7, rotation=0, ha="right", va="center")
        ax.tick_params(axis="x", labelsize=6)
    axes[-1, 0].set_xlabel("ms since the step began (one traced iteration per method)", fontsize=7)
    fig.suptitle(f"{result['workload']} seq {result['seq']} ({result['pass']}): where the time goes",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: list[dict]) -> str:
    """The results as markdown tables (what docs/benchmarks holds), one per workload and size."""
    pct = lambda x: "-" if x is None else f"{100 * x:.0f} %"
    out = []
    for r in results:
        out.append(f"**{r['workload']}**, seq {r['seq']}, d_model {r['d_model']}, {r['dtype']}, "
                   f"{r['pass']}, {r['world']} ranks: communication alone {r['comm_alone_ms']:.1f} ms, "
                   f"testbed limit {r['limit_ms']:.1f} ms\n")
        out.append("| method | median ms | p10-p90 ms | compute alone ms | exposed ms | hidden "
                   "| of limit | vs none |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for m in r["methods"]:
            out.append(f"| {m['method']} | {m['median_ms']:.1f} | {m['p10_ms']:.0f}-{m['p90_ms']:.0f} "
                       f"| {m['compute_ms']:.1f} | {m['exposed_ms']:.1f} | {pct(m.get('hidden'))} "
                       f"| {pct(m.get('of_limit'))} | {m.get('vs_none', float('nan')):.3f} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":  # python -m commfuse.bench.report results.json: markdown tables
    import sys

    for path in sys.argv[1:]:
        with open(path) as f:
            print(markdown(json.load(f)["results"]))

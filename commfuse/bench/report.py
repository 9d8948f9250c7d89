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
    paths = [os.path.join(out_dir, f"{stem}.json")]
    write_json(results, meta, paths[0])
    for r in results:
        if any(r["spans"]):
            p = os.path.join(out_dir, f"{stem}-{r['workload']}-{r['seq']}-{r['pass'][:3]}.trace.json")
            write_trace(r, p)
            paths.append(p)
    try:
        png = os.path.join(out_dir, f"{stem}.png")
        write_png(results, png, meta.get("title", stem))
        paths.append(png)
    except ImportError:
        print("[bench] matplotlib not installed: no PNG (pip install 'commfuse[bench]')")
    return paths

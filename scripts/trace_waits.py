"""How long each rank's traced step blocked in waits, per method: from the Chrome traces that
`commfuse bench op|layer` writes (one traced iteration per method, without ``--no-trace``).
A schedule that waits for nothing and still runs over its compute alone is slowed by the
transfers beside its compute, not held up by them (docs/benchmarks/2026-12-03-query-split.md).

    python scripts/trace_waits.py bench-out/layer-2r-attn_qsplit-4096-fwdbwd.trace.json
"""

from __future__ import annotations

import argparse
import json


def waits(path: str) -> list[tuple[str, int, float, float]]:
    """(method, rank, step ms, ms blocked in waits) per traced step of the file."""
    with open(path) as f:
        trace = json.load(f)["traceEvents"]
    events = [e for e in trace if e.get("ph") == "X"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace  # (pid, tid) -> track
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out = []
    for step in (e for e in events if threads.get((e["pid"], e["tid"])) == "step"):
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        blocked = sum(e["dur"] for e in events
                      if e["pid"] == step["pid"] and threads.get((e["pid"], e["tid"])) == "wait"
                      and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1)
        out.append((step["name"], step["pid"], step["dur"] / 1e3, blocked / 1e3))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="*.trace.json files of commfuse bench")
    args = p.parse_args(argv)
    print("| trace | method | rank | step ms | waits ms |\n|---|---|---:|---:|---:|")
    for path in args.traces:
        for method, rank, step, blocked in waits(path):
            print(f"| {path.rsplit('/', 1)[-1]} | {method} | {rank} | {step:.1f} | {blocked:.1f} |")


if __name__ == "__main__":
    main()

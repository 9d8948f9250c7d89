"""Markdown table of p50/p99 step time per method, without and with a straggler.

    python scripts/straggler_table.py BASE.json SLOW.json   # two `commfuse bench op` outputs

For each op and method: p50 and p99 (the slowest rank's step) in both runs, and how much the
straggler slowed the p50 and the p99 (slow / base).
"""

import json
import sys


def main(base_path: str, slow_path: str) -> None:
    base, slow = (json.load(open(p))["results"] for p in (base_path, slow_path))
    for rb, rs in zip(base, slow):
        assert (rb["workload"], rb["seq"]) == (rs["workload"], rs["seq"]), "runs differ"
        print(f"\n**{rb['workload']}**, seq {rb['seq']}, d_model {rb['d_model']}, "
              f"{rb['pass']}, {rb['world']} ranks\n")
        print("| method | p50 ms | p99 ms | p50 ms, straggler | p99 ms, straggler | "
              "p50 slowdown | p99 slowdown | p50 vs none, straggler |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        none = next(m for m in rs["methods"] if m["method"] == "none")["median_ms"]
        for mb, ms in zip(rb["methods"], rs["methods"]):
            print(f"| {mb['method']} | {mb['median_ms']:.1f} | {mb['p99_ms']:.1f} | "
                  f"{ms['median_ms']:.1f} | {ms['p99_ms']:.1f} | "
                  f"{ms['median_ms'] / mb['median_ms']:.2f}x | {ms['p99_ms'] / mb['p99_ms']:.2f}x | "
                  f"{ms['median_ms'] / none:.3f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])

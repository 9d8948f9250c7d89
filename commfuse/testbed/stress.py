"""Stress the failure path: kill / stall / link-down runs, over and over, on a loaded machine.

    python -m commfuse.testbed.stress --runs 50 --kinds kill,stall,linkdown --load 2

Each run is one `commfuse.testbed.faults.Case` (forked gloo ranks; the victim strikes at a GEMM
drawn at random, 0 = before the op), cycling through ops, methods and group sizes, while
``--load`` busy processes (GEMM loops, or pure spin) compete for the cores. Per run it records
the outcome (every survivor raised `commfuse.CommFuseError` / hang / silent success / other
error) and the slowest survivor's time to error, and prints a table per fault kind: the
counts and how many survivors took longer than the op's timeout + ``--slack-s``. ``linkdown``
needs root and iproute2 (an emulated network, `commfuse.testbed.net`); without them it is
skipped with a note. ``--max-minutes`` bounds the whole run; the exit code is 1 when any run
hung, succeeded silently, failed otherwise or was late.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

from commfuse.testbed import faults

# (op, method, opts, world): every method, both group sizes, ring and direct topologies, the
# P2P and the backend's collectives, and the exchanges some ops make before their schedule
# (auto's agreement on the method, checked mode's shapes).
CASES = (
    ("matmul_rs", "commfuse", (), 3),
    ("ag_matmul", "commfuse", (), 2),
    ("a2a_matmul", "commfuse", (("topology", "direct"),), 3),
    ("matmul_a2a", "decompose", (), 2),
    ("matmul_rs", "sliced", (), 3),
    ("ag_matmul", "none", (), 3),
    ("a2a_matmul", "sliced", (("collective", "backend"),), 2),
    ("matmul_rs", "none", (("collective", "backend"),), 2),
    ("matmul_rs", "auto", (), 3),
    ("ag_matmul", "commfuse", (("check", True),), 3),
)
MAX_AT = 3  # the victim strikes at GEMM 0 (before the op) .. MAX_AT
_LOAD = {  # one busy process: 1-thread GEMMs, or a pure-Python spin
    "gemm": "import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\n"
            "while True:\n    a @ a\n",
    "spin": "while True:\n    pass\n",
}


def cases(kind: str, runs: int, seed: int, timeout_s: float, first: int = 0) -> list[faults.Case]:
    """``runs`` cases of fault ``kind``: `CASES` in turn from index ``first``, the strike point
    drawn per run."""
    rng = random.Random(f"{seed}-{kind}")
    out = []
    for i in range(runs):
        op, method, opts, world = CASES[(first + i) % len(CASES)]
        out.append(faults.Case(kind, op, method, opts, world, victim=1,
                               at=rng.randint(0, MAX_AT), timeout_s=timeout_s))
    return out


class Load:
    """``n`` busy processes of ``kind`` (see `_LOAD`), stopped on exit."""

    def __init__(self, n: int, kind: str = "gemm"):
        self.procs = [subprocess.Popen([sys.executable, "-c", _LOAD[kind]],
                                       env={**os.environ, "OMP_NUM_THREADS": "1"},
                                       preexec_fn=faults.die_with_parent)
                      for _ in range(n)]

    def __enter__(self) -> "Load":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


class Network:
    """An emulated network for ``linkdown`` runs (one namespace per rank; a run of fewer ranks
    uses the first ones): built once, its links brought up again after each run; removed on
    exit. Fast links, the kernel's default super-packets: only a link's loss matters here."""

    def __init__(self, world: int):
        from commfuse.testbed import gso, links, net

        net.check_available()
        self.net = net.EmulatedNetwork([links.LinkSpec("10gbit", "0us")] * world,
                                       gso_bytes=gso.LEGACY_GSO)

    def __enter__(self):
        self.net.up()
        return self.net

    def __exit__(self, *exc) -> None:
        self.net.down()

    def reset(self) -> None:
        for port in self.net.ports:
            subprocess.run(["ip", "-n", port.netns, "link", "set", port.ifname, "up"],
                           check=True)


def linkdown_unavailable() -> str | None:
    """Why ``linkdown`` cannot run here (not root, no iproute2), or None."""
    from commfuse.testbed import net

    try:
        net.check_available()
    except net.EmulationUnavailable as e:
        return str(e).split(".")[0]
    return None


def run(kinds, runs: int, *, load: int = 2, load_kind: str = "gemm", timeout_s: float = 2.0,
        hang_s: float = 30.0, max_s: float | None = None, seed: int = 0, first: int = 0,
        progress=None) -> dict[str, list[faults.RunResult]]:
    """Run ``runs`` cases of each fault kind in ``kinds`` (`cases`), interleaved (kill, stall,
    linkdown, kill, ...), under ``load``; stop starting runs after ``max_s`` seconds.
    ``progress(kind, i, result)`` is called after each run. Kinds that cannot run here are
    left out."""
    skipped = linkdown_unavailable() if "linkdown" in kinds else None
    kinds = [k for k in kinds if not (k == "linkdown" and skipped)]
    plans = {k: cases(k, runs, seed, timeout_s, first) for k in kinds}
    results: dict[str, list[faults.RunResult]] = {k: [] for k in kinds}
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        network = None
        if "linkdown" in kinds:  # one network for every run, as large as the largest
            network = Network(max(c.world for c in plans["linkdown"]))
            stack.enter_context(network)
        stack.enter_context(Load(load, load_kind))
        for i in range(runs):
            for kind in kinds:
                if max_s is not None and time.monotonic() - start > max_s:
                    return results
                case = plans[kind][i]
                if kind == "linkdown":
                    network.reset()  # the last victim's link up again
                res = faults.run_case(case, hang_s, network.net if kind == "linkdown" else None)
                results[kind].append(res)
                if progress is not None:
                    progress(kind, i, res)
    return results


def late(res: faults.RunResult, slack_s: float) -> bool:
    """A survivor raised, but later than the op's timeout + ``slack_s``."""
    return res.worst_s is not None and res.worst_s > res.case.timeout_s + slack_s


def table(results: dict[str, list[faults.RunResult]], slack_s: float) -> str:
    """A markdown table: per kind, the outcomes and the survivors' times to error."""
    rows = ["| fault | runs | raised | hang | silent | other | late (> timeout + "
            f"{slack_s:g} s) | time to error: median / max (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for kind, res in results.items():
        count = {o: sum(r.outcome == o for r in res) for o in faults.OUTCOMES}
        times = [r.worst_s for r in res if r.worst_s is not None]
        spread = (f"{statistics.median(times):.2f} / {max(times):.2f}" if times else "-")
        rows.append(f"| {kind} | {len(res)} | {count['raised']} | {count['hang']} | "
                    f"{count['silent']} | {count['other']} | "
                    f"{sum(late(r, slack_s) for r in res)} | {spread} |")
    return "\n".join(rows)


def failed(results: dict[str, list[faults.RunResult]], slack_s: float) -> list[faults.RunResult]:
    """The runs that are not a prompt `CommFuseError` on every survivor."""
    return [r for res in results.values() for r in res
            if r.outcome != "raised" or late(r, slack_s)]


def _line(kind: str, i: int, runs: int, res: faults.RunResult) -> str:
    times = ", ".join("-" if r.elapsed_s is None else f"{r.elapsed_s:.2f}" for r in res.reports)
    return (f"[{kind} {i + 1}/{runs}] {res.case.label()}: {res.outcome} "
            f"(survivors' time to error {times} s; run {res.wall_s:.1f} s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m commfuse.testbed.stress",
        description="Run kill / stall / link-down faults repeatedly under CPU load and check "
                    "that every survivor raises CommFuseError within the op's timeout.")
    p.add_argument("--runs", type=int, default=50, help="runs per fault kind (default 50)")
    p.add_argument("--kinds", default="kill,stall,linkdown",
                   help=f"comma-separated fault kinds, of {', '.join(faults.FAULTS)}")
    p.add_argument("--load", type=int, default=2, help="busy processes beside the ranks (2)")
    p.add_argument("--load-kind", choices=sorted(_LOAD), default="gemm")
    p.add_argument("--timeout", type=float, default=2.0, help="the ops' timeout, s (2)")
    p.add_argument("--hang-s", type=float, default=30.0,
                   help="a survivor silent this long after the timeout is a hang (30)")
    p.add_argument("--slack-s", type=float, default=5.0,
                   help="an error later than timeout + this is late (5)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop starting runs after")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every run (case, outcome, per-survivor times) here")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in faults.FAULTS]
    if bad or args.runs < 1:
        p.error(f"unknown fault kind(s) {bad}" if bad else "--runs must be at least 1")
    if "linkdown" in kinds and (why := linkdown_unavailable()):
        print(f"linkdown skipped: {why}", file=sys.stderr)

    def progress(kind, i, res):
        print(_line(kind, i, args.runs, res), file=sys.stderr, flush=True)
        if res.outcome != "raised":
            for r in res.reports:
                print(f"    rank {r.rank}: {r.outcome}: {r.message[-1500:]}", file=sys.stderr)

    t0 = time.monotonic()
    results = run(kinds, args.runs, load=args.load, load_kind=args.load_kind,
                  timeout_s=args.timeout, hang_s=args.hang_s,
                  max_s=None if args.max_minutes is None else 60 * args.max_minutes,
                  seed=args.seed, progress=progress)
    print(table(results, args.slack_s))
    print(f"\n{sum(map(len, results.values()))} runs in {time.monotonic() - t0:.0f} s, "
          f"load {args.load} x {args.load_kind}, op timeout {args.timeout:g} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [dataclasses.asdict(r) for r in res] for k, res in results.items()},
                      f, indent=1)
    return 1 if failed(results, args.slack_s) else 0


if __name__ == "__main__":
    sys.exit(main())

"""One core's float32 GEMM rate against the number of rows, on every core at once (as the
benchmarks' ranks run): the evidence for the row overhead m0 that `commfuse.sim.probe` fits,
in docs/sim-vs-measured.md ("auto across K and N on the fitted model").

For each (K, N) of the K x N sweep and rows M in --rows, [M, K] @ [K, N] is timed on one
thread per process, one process pinned to each of --cores: the median of 5 batches after 2
warm-ups. The table gives the GFLOP/s of the slowest core, its ratio to the first M's (the
probe's 1024 rows), and the m0 that the model's efficiency 1 / (1 + m0/M + n0/N + k0/K)
needs to give that ratio (n0, k0 of the cpu-testbed preset).

    python scripts/gemm_rows.py --cores 0,1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

SHAPES = ((1024, 1024), (1024, 2048), (1024, 4096), (2048, 2048), (4096, 1024))


def _rates(core: int, rows: list[int], out) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    res = {}
    for k, n in SHAPES:
        b = torch.randn(k, n)
        for m in rows:
            a = torch.randn(m, k)
            reps = max(2, 4096 // m)
            for _ in range(2):
                a @ b
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps):
                    a @ b
                ts.append((time.perf_counter() - t0) / reps)
            res[(k, n, m)] = 2.0 * m * k * n / sorted(ts)[2]
    out.put(res)


def main(argv=None) -> None:
    from commfuse.sim.hardware import preset

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cores", default="0,1", help="one process pinned to each (default 0,1)")
    p.add_argument("--rows", default="1024,512,256,128",
                   help="values of M, the reference first (default: the probe's 1024)")
    a = p.parse_args(argv)
    cores, rows = [int(c) for c in a.cores.split(",")], [int(m) for m in a.rows.split(",")]
    q = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=_rates, args=(c, rows, q)) for c in cores]
    for pr in procs:
        pr.start()
    got = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    hw = preset("cpu-testbed")
    print("| K | N | M | GFLOP/s (slowest core) | / first M | m0 it implies |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k, n in SHAPES:
        big = min(g[(k, n, rows[0])] for g in got)
        c = hw.n0 / n + hw.k0 / k
        for m in rows:
            r = min(g[(k, n, m)] for g in got)
            den = r / m - big / rows[0]
            m0 = (big - r) * (1 + c) / den if m != rows[0] and den > 0 else float("nan")
            print(f"| {k} | {n} | {m} | {r / 1e9:.0f} | {r / big:.2f} | "
                  f"{'-' if m == rows[0] else f'{m0:.0f}'} |")


if __name__ == "__main__":
    main()

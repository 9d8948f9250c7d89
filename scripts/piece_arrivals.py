"""When each piece of an AG->GEMM arrives, beside when each GEMM ends: the commfuse schedule of
2 ranks (own slice's m pieces first, then the peer's as they arrive), written out by hand so
that a waiter thread can stamp each receive as it completes. The executor's own trace ends a
transfer's span at its wait, not at its arrival, so it cannot say which side of a step runs
late. Written for the one systematic misfit of the K x N sweep (m8 at S=4096, K=N=1024;
docs/sim-vs-measured.md, "The K x N sweep with the probe measured again").

    commfuse launch --nproc 2 --link 1gbit -- python scripts/piece_arrivals.py --splits 4,8

Rank 0 prints, per m, the medians over iterations (after one warm-up) of the step, the end of
each own-slice GEMM, each piece's arrival and the end of each peer-piece GEMM, in ms from the
step's start (after a barrier). Sends run on the ops' sender threads and duplex communicators
(`commfuse.runtime.gloo`), as in the ops.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.distributed as dist

from commfuse.runtime import gloo


def step(a, b, m: int, rank: int, peer: int):
    """One gathered GEMM in ``m`` pieces per slice: (seconds, arrivals, GEMM ends)."""
    rows, half = a.shape[0] // m, a.shape[0]
    got, out = torch.empty_like(a), torch.empty(2 * half, b.shape[1])
    arrived, ready = [0.0] * m, [threading.Event() for _ in range(m)]
    dist.barrier()
    t0 = time.perf_counter()
    piece = lambda x, j: x[j * rows:(j + 1) * rows]
    handles = gloo.post([dist.P2POp(dist.isend, piece(a, j), peer, tag=j) for j in range(m)] +
                        [dist.P2POp(dist.irecv, piece(got, j), peer, tag=j) for j in range(m)],
                        torch.device("cpu"))

    def waiter() -> None:  # the only thread that waits on the receives (each once)
        for j in range(m):
            handles[m + j].wait()
            arrived[j] = time.perf_counter() - t0
            ready[j].set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    ends = []
    for src, offset in ((a, rank * half), (got, peer * half)):
        for j in range(m):
            if src is got and not ready[j].wait(60):
                raise TimeoutError(f"piece {j} did not arrive within 60 s")
            torch.mm(piece(src, j), b, out=out[offset + j * rows:][:rows])
            ends.append(time.perf_counter() - t0)
    thread.join()
    for h in handles[:m]:
        h.wait()
    return time.perf_counter() - t0, arrived, ends


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]
    p.add_argument("--seq", type=int, default=4096, help="S, the gathered rows (default 4096)")
    p.add_argument("--k", type=int, default=1024, help="K, the width that moves")
    p.add_argument("--n", type=int, default=1024, help="N, B's columns")
    p.add_argument("--splits", type=ints, default=[4, 8], help="values of m (default 4,8)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per m (default 8)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("piece_arrivals: run it on 2 ranks (commfuse launch --nproc 2)")
    gloo.duplex()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    a = torch.randn(args.seq // 2, args.k, generator=gen)
    b = torch.randn(args.k, args.n, generator=gen)
    runs = {m: [] for m in args.splits}
    for i in range(1 + args.iters):  # the methods interleaved, the first round a warm-up
        for m in args.splits:
            if i:
                runs[m].append(step(a, b, m, rank, 1 - rank))
            else:
                step(a, b, m, rank, 1 - rank)
    if rank == 0:
        ms = lambda xs: ", ".join(f"{1e3 * x:.0f}" for x in xs)
        for m, v in runs.items():
            med = lambda key, j: statistics.median(run[key][j] for run in v)
            print(f"m{m}: step {1e3 * statistics.median(run[0] for run in v):.1f} ms\n"
                  f"  own GEMMs end   {ms(med(2, j) for j in range(m))}\n"
                  f"  pieces arrive   {ms(med(1, j) for j in range(m))}\n"
                  f"  peer GEMMs end  {ms(med(2, m + j) for j in range(m))}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

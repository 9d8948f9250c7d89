"""Measure what the emulated links deliver: one-way and both-ways-at-once gloo transfer rates.

    commfuse launch --nproc 2 --link 1gbit -- python scripts/link_probe.py

Rank 1 prints, per message size, the one-way rate (rank 0 sends, timed at the receiver) and
the rate each way when both ranks send to each other at once (what every method does at W=2),
on the default gloo group (one TCP connection per pair of ranks, which the ops'
`commfuse.runtime.gloo.duplex` communicators split into one per direction).

Then, per size from 64 KiB to 8 MiB, one message sent after the link has been idle for 30 ms,
over the time the link's rate would take (from COMMFUSE_LINK): below 1 where tbf's burst
lets the message's start leave at once, above where TCP restarting after idle holds it back
(docs/design.md, "Super-packets"; results in docs/benchmarks/testbed.md).
"""

import os
import time

import torch
import torch.distributed as dist

from commfuse.testbed.links import parse_rate


def median_time(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def main() -> None:
    dist.init_process_group("gloo")
    r = dist.get_rank()
    for mb in (4, 16):
        x, y = torch.ones(mb << 18), torch.empty(mb << 18)  # mb MiB of float32

        def one_way():
            dist.send(x, 1) if r == 0 else dist.recv(y, 0)

        def both_ways():
            ops = [dist.P2POp(dist.isend, x, 1 - r), dist.P2POp(dist.irecv, y, 1 - r)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        t1, t2 = median_time(one_way), median_time(both_ways)
        if r == 1:
            gbit = mb * 8 * 1.048576 / 1e3
            print(f"{mb} MiB: one-way {gbit / t1:.2f} Gbit/s, both ways {gbit / t2:.2f} Gbit/s "
                  f"each", flush=True)
    rate = parse_rate(os.environ.get("COMMFUSE_LINK", "1gbit").split()[0])
    for kib in (64, 256, 1024, 2048, 8192):
        x = torch.ones(kib << 8)

        def after_idle():
            time.sleep(0.03)
            dist.barrier()
            t0 = time.perf_counter()
            dist.send(x, 1) if r == 0 else dist.recv(x, 0)
            return time.perf_counter() - t0
        t = sorted(after_idle() for _ in range(7))[3]
        if r == 1:
            line = kib * 1024 * 8 / rate
            print(f"{kib} KiB after 30 ms idle: {t * 1e3:.2f} ms, {t / line:.2f} of its "
                  f"line-rate time ({line * 1e3:.2f} ms)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

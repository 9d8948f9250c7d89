"""What `Hardware.first_touch_bandwidth` / `first_touch_bytes` model: the page faults of fresh
buffers (glibc hands buffers of 32 MiB and more back to the kernel, so each one faults
again), on one core, one intra-op thread. Two tables, medians:

- fill: a fresh buffer's first write against a rewrite of a reused one, per size (which
  sizes fault depends on what was freed before: glibc's mmap threshold moves);
- GEMM: ``a @ b`` into a fresh output against ``torch.mm(a, b, out=reused)``, the extra
  seconds per GB of output (the preset's 2.4 GB/s is 1 / 0.42 s/GB).

    python scripts/first_touch.py
"""
import statistics
import time

import torch


def median_s(fn, n=9) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


torch.set_num_threads(1)
print(f"{'fill MiB':>9} {'fresh GB/s':>11} {'reused GB/s':>12} {'extra s/GB':>11}")
for mib in (8, 16, 24, 32, 48, 64):
    n = mib * 2 ** 20 // 4
    reused = torch.ones(n)
    fresh = median_s(lambda: torch.empty(n).fill_(1.0), 15)
    again = median_s(lambda: reused.fill_(2.0), 15)
    gb = n * 4 / 1e9
    print(f"{mib:>9} {gb / fresh:>11.2f} {gb / again:>12.2f} {(fresh - again) / gb:>11.3f}")
print(f"\n{'GEMM M x K x N':>16} {'out MiB':>8} {'fresh GFLOP/s':>14} {'reused':>7} "
      f"{'extra s/GB':>11}")
for M, K, N in ((2048, 1024, 2048), (2048, 1024, 4096), (4096, 1024, 2048), (4096, 2048, 4096)):
    a, b, out = torch.randn(M, K), torch.randn(K, N), torch.empty(M, N)
    fresh = median_s(lambda: a @ b)
    again = median_s(lambda: torch.mm(a, b, out=out))
    gb, flop = M * N * 4 / 1e9, 2 * M * K * N
    print(f"{f'{M} x {K} x {N}':>16} {M * N * 4 >> 20:>8} {flop / fresh / 1e9:>14.0f} "
          f"{flop / again / 1e9:>7.0f} {(fresh - again) / gb:>11.3f}", flush=True)

"""The checks that run real ranks on the GPU: every op and method on a 1-rank NCCL group,
``commfuse train --device cuda``, the exactness cases on several GPUs, and what cutting a GEMM
into slices costs."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch


def _dist_cases():
    """``tests/dist_cases.py`` of the source checkout: the same exactness cases the CPU suite
    runs on gloo, here on NCCL (a wheel without the tests cannot run these two checks)."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "dist_cases.py").is_file():
        raise RuntimeError(f"needs tests/dist_cases.py of a commfuse source checkout ({tests})")
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import dist_cases

    return dist_cases


def _single_rank(rank, world):
    from commfuse.ops.attention import query_split_attention

    dc = _dist_cases()
    cases = [c for c in dc.all_cases() if c.dim == 0 or c.uneven]
    bad = {k: v for k, v in dc.run_cases(rank, world, cases, "cuda").items() if v}
    q, k, v = (torch.randn(64, 2, 4, 16, device="cuda", dtype=torch.float64) for _ in range(3))
    wo = torch.randn(64, 32, device="cuda", dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True).permute(2, 0, 1, 3)
    out = query_split_attention(q, k, v, wo)
    if not torch.allclose(out, ref.reshape(64, 2, 64) @ wo):
        bad["query_split_attention"] = "differs"
    return len(cases), bad


def check_single_rank(report):
    from commfuse.testbed.spawn import run_local

    n, bad = run_local(_single_rank, 1, backend="nccl", timeout=240)[0]
    report["single_rank"] = {"cases": n, "failures": dict(list(bad.items())[:20])}
    return f"{len(bad)} of {n} cases failed, e.g. {next(iter(bad.items()))}" if bad else None


def check_train(report):
    from commfuse.train.__main__ import main

    rc = main(["--device", "cuda", "--tp", "1", "--steps", "3", "--seq-len", "64",
               "--batch-size", "4"])
    return None if rc == 0 else f"exit status {rc}"


def _bench(rank, world, seq, d, iters):
    """AG->GEMM and GEMM->RS, bf16, each method's basic variant, CUDA-event timed."""
    import torch.distributed as dist

    from commfuse.ops import registry
    from commfuse.schedule import VARIANTS

    g = torch.Generator(device="cuda").manual_seed(rank)
    out = {}
    for op in ("ag_matmul", "matmul_rs"):
        a, b = (torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
                for s in registry.layer_shapes(op, world, seq, d))
        for label in registry.BASIC_VARIANTS:
            call = lambda: registry.call(op, a, b, *VARIANTS[label])
            for _ in range(3):
                call()
            times = []
            for _ in range(iters):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            out[f"{op} {label}"] = statistics.median(times)
    return out


def check_nccl(report):
    from commfuse.testbed.spawn import run_local

    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        report["nccl"] = "skipped: 1 GPU (NCCL needs a GPU per rank)"
        return "skip"
    dc = _dist_cases()
    cases = [c for c in dc.all_cases() if c.dtype == torch.float32 and (c.dim == 0 or c.uneven)]
    res = run_local(dc.run_cases, world, cases, "cuda", backend="nccl", timeout=150, pg_timeout_s=60)
    bad = {c.id: [r[c.id] for r in res if r[c.id]] for c in cases}
    bad = {k: v for k, v in bad.items() if v}
    times = run_local(_bench, world, 8192, 4096, 10, backend="nccl", timeout=90)[0]
    report["nccl"] = {"world": world, "cases": len(cases), "failures": dict(list(bad.items())[:20]),
                      "ms_rank0": times}
    for k, v in times.items():
        print(f"    {k:<28} {v:8.3f} ms")
    return f"{len(bad)} of {len(cases)} failed, e.g. {next(iter(bad.items()))}" if bad else None


def _time(fn, iters=10) -> float:
    """Median GPU seconds of ``fn`` (`commfuse.check_gpu.perf.events_ms`)."""
    from commfuse.check_gpu.perf import events_ms
    return events_ms(fn, iters, warm=2) / 1e3


def check_split_gemm(report):
    """TFLOP/s of the slice GEMMs of a W*m-way split against the unsplit GEMM."""
    rows, K, N = [], 4096, 4096
    for seq in (4096, 1024):
        M = 32 * seq
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        flop = 2 * M * K * N
        whole = flop / _time(lambda: torch.matmul(a, b, out=y)) / 1e12
        for w in (2, 4, 8):
            for m in (1, 4):
                n = M // (w * m)
                pieces = [(a[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(w * m)]
                split = flop / _time(lambda: [torch.matmul(x, b, out=o) for x, o in pieces]) / 1e12
                rows.append({"M": M, "K": K, "N": N, "W": w, "m": m, "slice_rows": n,
                             "unsplit_tflops": whole, "split_tflops": split,
                             "efficiency": split / whole})
                print(f"    M={M:>6} W={w} m={m} slice {n:>6} rows: {split:7.1f} TFLOP/s vs "
                      f"unsplit {whole:7.1f} ({split / whole:.1%})")
        a = b = y = None  # this size's tensors freed before the next one's
    report["split_gemm"] = rows
    return None

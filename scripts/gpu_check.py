"""The CUDA path on a lent GPU: exactness of every op and method through NCCL, and times.

Run on the GPU machine: ``PYTHONPATH=.:tests python3 scripts/gpu_check.py OUTDIR``.
Tries 2 NCCL ranks first (more ranks than GPUs: NCCL may refuse two ranks on one GPU), then
falls back to 1 rank, which still runs the CUDA transport (comm stream, events) for the
collective methods and every op's GEMMs and autograd on the GPU.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from commfuse.ops import registry
from commfuse.schedule import VARIANTS
from commfuse.testbed.spawn import run_local
from dist_cases import all_cases, run_cases


def probe(rank, world):
    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    y = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, y, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize()
    return y[0].item()


def bench(rank, world, seq, d, iters):
    """AG->GEMM and GEMM->RS, bf16, each method's basic variant, timed around each call."""
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


def main(outdir):
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
    print(report, flush=True)
    world = 1
    try:
        got = run_local(probe, 2, backend="nccl", timeout=120, pg_timeout_s=60)
        report["nccl_2_ranks_one_gpu"] = f"ok {got}"
        world = 2
    except Exception as e:
        report["nccl_2_ranks_one_gpu"] = f"failed: {str(e)[-600:]}"
    print("2 NCCL ranks:", report["nccl_2_ranks_one_gpu"], flush=True)
    cases = all_cases()
    t0 = time.time()
    res = run_local(run_cases, world, cases, "cuda", backend="nccl", timeout=400, pg_timeout_s=60)
    bad = {c.id: [r[c.id] for r in res if r[c.id]] for c in cases}
    bad = {k: v for k, v in bad.items() if v}
    report["exactness"] = {"world": world, "cases": len(cases), "failed": len(bad),
                           "failures": dict(list(bad.items())[:20]), "seconds": time.time() - t0}
    print("exactness:", report["exactness"]["cases"], "cases,", len(bad), "failed", flush=True)
    for k, v in list(bad.items())[:10]:
        print("  ", k, v[0][:300])
    report["bench"] = run_local(bench, world, 8192, 4096, 10, backend="nccl", timeout=300)
    for k, v in report["bench"][0].items():
        print(f"  {k:<28} {v:8.3f} ms (rank 0)")
    with open(os.path.join(outdir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("outdir", nargs="?", default=".", help="folder for gpu_check.json (default .)")
    main(p.parse_args().outdir)

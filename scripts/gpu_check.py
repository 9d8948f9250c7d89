"""The CUDA path on a lent GPU: exactness of every op and method through NCCL, and times.

Run on the GPU machine: ``PYTHONPATH=.:tests python3 scripts/gpu_check.py OUTDIR``.
Tries 2 NCCL ranks first (more ranks than GPUs: NCCL may refuse two ranks on one GPU), then
falls back to 1 rank, which still runs the CUDA transport (comm stream, events) for the
collective methods and every op's GEMMs and autograd on the GPU.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import commfuse
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
    """AG->GEMM and GEMM->RS, bf16, every method, CUDA events around each call."""
    torch.manual_seed(rank)
    out = {}
    a_ag = torch.randn(seq // world, d, device="cuda", dtype=torch.bfloat16)
    b_ag = torch.randn(d, 4 * d // world, device="cuda", dtype=torch.bfloat16)
    a_rs = torch.randn(seq, 4 * d // world, device="cuda", dtype=torch.bfloat16)
    b_rs = torch.randn(4 * d // world, d, device="cuda", dtype=torch.bfloat16)
    calls = {
        "ag_matmul": lambda m, o: commfuse.fused_all_gather_matmul(a_ag, [b_ag], 0, method=m, **o),
        "matmul_rs": lambda m, o: commfuse.fused_matmul_reduce_scatter(a_rs, b_rs, "sum", 0, method=m, **o),
    }
    variants = [("none", {}), ("sliced", {"chunks": 4}), ("decompose", {}),
                ("commfuse", {"topology": "ring"}), ("commfuse", {"topology": "direct"})]
    for op, call in calls.items():
        for m, o in variants:
            for _ in range(3):
                call(m, o)
            times = []
            for _ in range(iters):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call(m, o)
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            out[f"{op} {m} {o.get('topology', o.get('chunks', ''))}"] = statistics.median(times)
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
    main(sys.argv[1] if len(sys.argv) > 1 else ".")

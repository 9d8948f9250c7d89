"""The CUDA path on a GPU: one command, pass/fail per check, under 5 minutes.

    commfuse check-gpu [--out DIR] [--only NAME ...]       # or: python -m commfuse.check_gpu
    TORCH_CUDA_SANITIZER=1 commfuse check-gpu --only loopback

Checks (each prints PASS/FAIL and its time; the JSON report goes to DIR/check_gpu.json):

- ``loopback``: W = 2, 3, 4 virtual ranks in one process on one GPU (NCCL refuses two ranks
  on one GPU), each a daemon thread with its own compute stream, running every op under every
  named method through `CudaTransport` (comm stream, events, held buffers), its batches and
  collectives matched as NCCL matches them (`commfuse.runtime.nccl_model`: issue order per
  rank and per pair, tags ignored) and copied on a side stream after both sides' streams;
  results equal to the unsharded GEMMs'; a deadlock is reported, not hung. Under
  ``TORCH_CUDA_SANITIZER=1`` PyTorch's CUDA sanitizer reports any unsynchronised access.
- ``single_rank``: every op and method through the public API on a 1-rank NCCL group
  (outputs and gradients, the CUDA autograd path) and query-split attention.
- ``train``: ``commfuse train --device cuda`` for 3 steps on 1 rank.
- ``nccl``: with 2 or more GPUs, the exactness cases of tests/dist_cases.py on
  min(GPUs, 4) NCCL ranks (float32 and uneven sizes), and the ops' times per method.
- ``split_gemm``: the split-GEMM efficiency at the paper's TPSP MLP shape ((batch, seq,
  d_model) = (32, 4096, 4096) on TP=4: M = 131072 tokens, K = N = 4096, bf16) and at seq
  1024: TFLOP/s of W*m slice GEMMs against the unsplit GEMM (what cutting costs).

``single_rank`` and ``nccl`` take their cases from tests/dist_cases.py, so they need a source
checkout. Without a CUDA device the command says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

CHECKS = ("loopback", "single_rank", "train", "nccl", "split_gemm")


def _check(name: str):
    from commfuse.check_gpu import checks, loopback

    return getattr(loopback if name == "loopback" else checks, f"check_{name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commfuse check-gpu", description=__doc__.split("\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".", help="folder for check_gpu.json (default .)")
    p.add_argument("--only", nargs="+", choices=CHECKS, help="run only these checks")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"commfuse check-gpu: no CUDA device (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}): nothing to check", file=sys.stderr)
        return 2
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
              "sanitizer": os.environ.get("TORCH_CUDA_SANITIZER", ""), "checks": {}}
    print({k: v for k, v in report.items() if k != "checks"}, flush=True)
    failed = 0
    for name in args.only or CHECKS:
        t0 = time.time()
        try:
            err = _check(name)(report)
        except Exception:
            err = traceback.format_exc()[-1500:]
        status = "SKIP" if err == "skip" else "FAIL" if err else "PASS"
        failed += status == "FAIL"
        report["checks"][name] = {"status": status, "error": err, "seconds": time.time() - t0}
        print(f"{status} {name} ({time.time() - t0:.1f} s){': ' + err if status == 'FAIL' else ''}",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"check-gpu: {failed} check(s) failed" if failed else "check-gpu: all checks passed")
    return 1 if failed else 0

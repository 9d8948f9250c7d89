"""The CUDA path on a GPU: one command, a pass/fail table, under 8 minutes.

    commfuse check-gpu [--out DIR] [--only NAME ...] [--require-gpu]   # or python -m commfuse.check_gpu
    TORCH_CUDA_SANITIZER=1 commfuse check-gpu --only loopback

Checks (each prints PASS/FAIL/SKIP/NOT RUN and its time; the JSON report, DIR/check_gpu.json,
is rewritten after each check, so a run cut short keeps what it measured):

- ``loopback``: W = 2, 3, 4 virtual ranks in one process (NCCL refuses two ranks on one GPU),
  each a daemon thread with its own compute stream, running every op under every named method
  through `CudaTransport` (comm stream, events, held buffers, preallocated receives), its
  batches and collectives matched as NCCL matches them (`commfuse.runtime.nccl_model`: issue
  order per rank and per pair, tags ignored) and copied on a side stream after both sides'
  streams; results equal to the unsharded GEMMs'; a deadlock is reported, not hung. Under
  ``TORCH_CUDA_SANITIZER=1`` PyTorch's CUDA sanitizer reports any unsynchronised access.
  Without a GPU it runs on CPU (host copies): the one check CI can run.
- ``nccl_p2p``: real NCCL P2P on a one-rank group sending to itself through `CudaTransport`:
  exact bytes, one work per batch, not complete right after posting, a deadline wait that
  leaves the host free, no host sync in a warm op (``torch.cuda.set_sync_debug_mode``).
- ``overlap``: a slice GEMM beside the same bytes in flight, CUDA-event timed alone and
  together (overlap fraction), with high- and default-priority communication streams.
- ``host_vs_gpu``: host time per fused op against GPU time per op (P2P methods, rank 0 of 2
  in a self-loop), and the host's cost per post.
- ``memory``: allocated memory over 20 warm calls per op and method (no growth), each
  method's peak against ``none``'s.
- ``single_rank``: every op and method through the public API on a 1-rank NCCL group
  (outputs and gradients, the CUDA autograd path) and query-split attention.
- ``train``: ``commfuse train --device cuda`` for 3 steps on 1 rank.
- ``nccl``: with 2 or more GPUs, the exactness cases of tests/dist_cases.py on
  min(GPUs, 4) NCCL ranks (float32 and uneven sizes), and the ops' times per method.
- ``split_gemm``: the split-GEMM efficiency at the paper's TPSP MLP shape ((batch, seq,
  d_model) = (32, 4096, 4096) on TP=4: M = 131072 tokens, K = N = 4096, bf16) and at seq
  1024: TFLOP/s of W*m slice GEMMs against the unsplit GEMM (what cutting costs).

``single_rank`` and ``nccl`` take their cases from tests/dist_cases.py, so they need a source
checkout. Without a CUDA device the loopback runs on CPU and every other check is marked
NOT RUN (never passed); the exit status is 0 if nothing failed, 1 if a check failed, and 2
without a CUDA device under ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

CHECKS = ("loopback", "nccl_p2p", "overlap", "host_vs_gpu", "memory", "single_rank", "train",
          "nccl", "split_gemm")
CPU_CHECKS = ("loopback",)  # what runs without a GPU (on CPU virtual ranks)


def _check(name: str):
    from commfuse.check_gpu import checks, loopback, perf

    module = loopback if name == "loopback" else perf if hasattr(perf, f"check_{name}") \
        else checks
    return getattr(module, f"check_{name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commfuse check-gpu", description=__doc__.split("\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".", help="folder for check_gpu.json (default .)")
    p.add_argument("--only", nargs="+", choices=CHECKS, help="run only these checks")
    p.add_argument("--require-gpu", action="store_true",
                   help="exit with status 2 when there is no CUDA device (default: run the "
                        "loopback on CPU and mark the GPU checks NOT RUN)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:
        print(f"commfuse check-gpu: no CUDA device (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}): " + ("nothing to check" if args.require_gpu else
                                            "loopback on CPU, the GPU checks not run"),
              file=sys.stderr)
        if args.require_gpu:
            return 2
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
              "gpu": torch.cuda.get_device_name(0) if gpu else None,
              "gpus": torch.cuda.device_count(), "device": "cuda" if gpu else "cpu",
              "sanitizer": os.environ.get("TORCH_CUDA_SANITIZER", ""),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "checks": {}}
    print({k: v for k, v in report.items() if k != "checks"}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or CHECKS:
        t0 = time.time()
        if not gpu and name not in CPU_CHECKS:
            status, err = "NOT RUN", "no CUDA device"
        else:
            try:
                fn = _check(name)
                err = fn(report) if gpu else fn(report, device="cpu")
            except Exception:
                err = traceback.format_exc()[-1500:]
            status = "SKIP" if err == "skip" else "FAIL" if err else "PASS"
        report["checks"][name] = {"status": status, "error": err, "seconds": time.time() - t0,
                                  "device": report["device"]}
        print(f"{status} {name} ({time.time() - t0:.1f} s)"
              f"{': ' + err if status == 'FAIL' else ''}", flush=True)
        _write(report, args.out)  # after each check: a run cut short keeps what it measured
    print(table(report))
    failed = sum(c["status"] == "FAIL" for c in report["checks"].values())
    print(f"check-gpu: {failed} check(s) failed" if failed else
          "check-gpu: no check failed" + ("" if gpu else " (GPU checks NOT RUN: no CUDA device)"))
    return 1 if failed else 0


def _write(report: dict, out: str) -> None:
    with open(os.path.join(out, "check_gpu.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def table(report: dict) -> str:
    """The pass/fail table of ``report``: check, status, device, seconds."""
    lines = [f"{'check':<12} {'status':<8} {'device':<6} {'seconds':>8}"]
    for name, c in report["checks"].items():
        lines.append(f"{name:<12} {c['status']:<8} {c['device']:<6} {c['seconds']:8.1f}")
    return "\n".join(lines)

"""The demo: every op with every method on local ranks, checked against ``none``, timed.

Ranks are local processes on gloo over loopback. With more ranks than cores they time-share
the CPU, so the times say nothing about overlap (see ``commfuse bench`` on an emulated
cluster for that); the demo shows the ops agree and how to call them.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from commfuse.ops import registry
from commfuse.schedule import OPS, VARIANTS
from commfuse.testbed.spawn import run_local


def _inputs(op: str, world: int, rank: int, seq: int, d: int, dtype):
    """The op's inputs in its layer (`commfuse.ops.registry.layer_shapes`), as leaves."""
    g = torch.Generator().manual_seed(1000 + rank)
    return tuple(torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
                 for s in registry.layer_shapes(op, world, seq, d))


def _time(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, seq: int, d: int, iters: int, dtype_name: str) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    rows = []
    for op in OPS:
        a, b = _inputs(op, world, rank, seq, d, dtype)
        call = lambda label: registry.call(op, a, b, *VARIANTS[label])
        ref = call("none")
        ref.backward(torch.ones_like(ref))
        ref_ga, ref_gb = a.grad.clone(), b.grad.clone()
        for label in registry.BASIC_VARIANTS:
            a.grad = b.grad = None
            out = call(label)
            out.backward(torch.ones_like(out))
            err = max(_rel(out, ref), _rel(a.grad, ref_ga), _rel(b.grad, ref_gb))
            with torch.no_grad():
                fwd = _time(lambda: call(label), iters)

            def step():
                y = call(label)
                y.backward(torch.ones_like(y))
            both = _time(step, iters)
            rows.append({"op": op, "method": label, "err": err,
                         "fwd_ms": 1e3 * fwd, "fwd_bwd_ms": 1e3 * both})
        if rank == 0:
            print(f"[demo] {op}: {len(registry.BASIC_VARIANTS)} methods checked and timed",
                  flush=True)
    return rows


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def main(args) -> int:
    print(f"[demo] {args.nproc} local ranks (gloo), seq {args.seq}, d_model {args.d_model}, "
          f"{args.dtype}, {args.iters} timed iterations after warm-up")
    per_rank = run_local(_rank, args.nproc, args.seq, args.d_model, args.iters, args.dtype,
                         timeout=args.timeout)
    tol = 1e-4 if args.dtype == "float32" else 5e-2
    ok = True
    header = f"{'op':<11} {'method':<16} {'fwd ms':>8} {'vs none':>8} {'fwd+bwd ms':>11} " \
             f"{'vs none':>8} {'max rel err vs none':>20}"
    print("\n" + header + "\n" + "-" * len(header))
    for i, row in enumerate(per_rank[0]):
        worst = [r[i] for r in per_rank]  # a step is as slow as its slowest rank
        fwd, both = max(r["fwd_ms"] for r in worst), max(r["fwd_bwd_ms"] for r in worst)
        err = max(r["err"] for r in worst)
        base = [r for r in per_rank[0] if r["op"] == row["op"]][0]
        base_f = max(r[per_rank[0].index(base)]["fwd_ms"] for r in per_rank)
        base_b = max(r[per_rank[0].index(base)]["fwd_bwd_ms"] for r in per_rank)
        agree = err <= tol
        ok &= agree
        print(f"{row['op']:<11} {row['method']:<16} {fwd:8.2f} {fwd / base_f:8.2f} {both:11.2f} "
              f"{both / base_b:8.2f} {err:15.1e} {'ok' if agree else 'DIFFERS'}")
    print(f"\n[demo] {'all methods agree with none' if ok else 'SOME METHODS DIFFER'} "
          f"(outputs and gradients, tolerance {tol:.0e}).")
    print("[demo] times are on local ranks sharing this machine's cores over loopback: they "
          "show no overlap; measure that with an emulated network (see README).")
    return 0 if ok else 1

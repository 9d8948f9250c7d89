"""The CUDA path on a GPU: one command, pass/fail per check, under 5 minutes.

    PYTHONPATH=. python3 scripts/gpu_check.py [--out DIR] [--only NAME ...]
    TORCH_CUDA_SANITIZER=1 PYTHONPATH=. python3 scripts/gpu_check.py --only loopback

Checks (each prints PASS/FAIL and its time; the JSON report goes to DIR/gpu_check.json):

- ``loopback``: W = 2, 3, 4 virtual ranks in one process on one GPU (NCCL refuses two ranks
  on one GPU), each a thread with its own compute stream, running every op's decompose and
  commfuse schedules (ring, direct, splits 1 and 2) through `CudaTransport` (comm stream,
  events, held buffers) with a loopback backend that copies each send into its receive on a
  side stream, after both batches' streams; results against the unsharded GEMMs. Under
  ``TORCH_CUDA_SANITIZER=1`` PyTorch's CUDA sanitizer reports any unsynchronised access.
- ``single_rank``: every op and method through the public API on a 1-rank NCCL group
  (outputs and gradients, the CUDA autograd path) and query-split attention.
- ``train``: ``commfuse train --device cuda`` for 3 steps on 1 rank.
- ``nccl``: with 2 or more GPUs, the exactness cases of tests/dist_cases.py on
  min(GPUs, 4) NCCL ranks (float32 and uneven sizes), and the ops' times per method.
- ``split_gemm``: the split-GEMM efficiency at the paper's TPSP MLP shape ((batch, seq,
  d_model) = (32, 4096, 4096) on TP=4: M = 131072 tokens, K = N = 4096, bf16) and at seq
  1024: TFLOP/s of W*m slice GEMMs against the unsplit GEMM (what cutting costs).

Without a CUDA device it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

DEVICE = "cuda"  # the loopback check's device (a CPU dry run of its plumbing sets "cpu")
CHECKS = ("loopback", "single_rank", "train", "nccl", "split_gemm")


# -- loopback: virtual ranks in threads -------------------------------------------------------
class _Hub:
    """Matches sends with receives by (src, dst, tag) across the virtual ranks."""

    def __init__(self):
        self.cv, self.waiting = threading.Condition(), {}


class _Work:
    """A batch: done when every transfer's copy is (NCCL: one work per batch)."""

    def __init__(self, hub, n):
        self.hub, self.n, self.events = hub, n, []

    def _matched(self):
        with self.hub.cv:
            self.hub.cv.wait_for(lambda: len(self.events) == self.n, timeout=60)
            if len(self.events) != self.n:
                raise TimeoutError("loopback: the peer never posted the matching transfer")

    def is_completed(self):
        return len(self.events) == self.n and all(e.query() for e in self.events)

    def wait(self, timeout=None):
        self._matched()
        for e in self.events:
            torch.cuda.current_stream().wait_event(e)
        return True


def _loopback_backend(hub, rank):
    from commfuse.runtime.cuda import Backend

    class Loopback(Backend):
        """NCCL's semantics on one GPU: a batch waits for the stream current at issue; each
        transfer is a copy on a side stream once both sides are issued."""

        def __init__(self):
            super().__init__()
            self.side = torch.cuda.Stream()

        def issue(self, group, transfers):
            ready = self.record_event(torch.cuda.current_stream())
            work = _Work(hub, len(transfers))
            with hub.cv:
                for t, buf in transfers:
                    key = (rank, t.peer, t.tag) if t.kind == "send" else (t.peer, rank, t.tag)
                    other = hub.waiting.pop(key, None)
                    if other is None:
                        hub.waiting[key] = (t.kind, buf, ready, work)
                        continue
                    kind, obuf, oready, owork = other
                    src, dst = (buf, obuf) if t.kind == "send" else (obuf, buf)
                    self.side.wait_event(ready)
                    self.side.wait_event(oready)
                    with torch.cuda.stream(self.side):
                        dst.copy_(src)
                        src.record_stream(self.side)
                        dst.record_stream(self.side)
                    done = self.record_event(self.side)
                    work.events.append(done)
                    owork.events.append(done)
                hub.cv.notify_all()
            return work

    return Loopback()


class _Group:
    """What the ops' inner functions read of a group, carrying the loopback backend."""

    def __init__(self, world, rank, backend):
        self.w, self.r, self.commfuse_backend = world, rank, backend

    def size(self):
        return self.w

    def rank(self):
        return self.r


def _loopback_case(op, world, spec, dtype=torch.float32):
    from commfuse.ops import ag_matmul, all_to_all, matmul_rs

    s, K, N = 96, 64, 48 * world
    g = torch.Generator(device=DEVICE).manual_seed(world)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=DEVICE, dtype=dtype)
    hub, sizes = _Hub(), tuple(s + 8 * (p % 2) for p in range(world))  # uneven slices
    S = sum(sizes)
    offs = [sum(sizes[:p]) for p in range(world)]
    if op == "ag_matmul":
        a = [rnd(n, K) for n in sizes]
        b = [rnd(K, N) for _ in range(world)]
        full = torch.cat(a)
        ref = [full @ b[r] for r in range(world)]
        call = lambda r, grp: ag_matmul.ag_matmul(a[r], [b[r]], sizes, grp, spec)[1][0]
    elif op == "matmul_rs":
        x = [rnd(S, K) for _ in range(world)]
        b = [rnd(K, N) for _ in range(world)]
        tot = sum(x[r] @ b[r] for r in range(world))
        ref = [tot[offs[r]:offs[r] + sizes[r]] for r in range(world)]
        call = lambda r, grp: matmul_rs.matmul_rs([(x[r], b[r])], None, sizes, grp, spec)
    elif op == "matmul_a2a":
        a, B, n = [rnd(n, K) for n in sizes], rnd(K, N), N // world
        y = torch.cat(a) @ B
        ref = [y[:, r * n:(r + 1) * n] for r in range(world)]
        call = lambda r, grp: all_to_all.matmul_a2a(a[r], B, sizes, grp, spec)
    else:
        k = K // world
        a, B = [rnd(S, k) for _ in range(world)], rnd(world * k, N)
        x = torch.cat(a, -1) @ B
        ref = [x[offs[r]:offs[r] + sizes[r]] for r in range(world)]
        call = lambda r, grp: all_to_all.a2a_matmul(a[r], B, sizes, grp, spec)[0]
    torch.cuda.synchronize()
    outs, errors = [None] * world, []

    def rank_main(r):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):  # this virtual rank's compute stream
                outs[r] = call(r, _Group(world, r, _loopback_backend(hub, r)))
                torch.cuda.current_stream().synchronize()
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        return errors[0][-800:]
    bad = [r for r in range(world)
           if not torch.allclose(outs[r], ref[r], rtol=1e-4, atol=1e-4 * ref[r].abs().max().item())]
    return f"ranks {bad} differ" if bad else None


def check_loopback(report):
    from commfuse.ops.methods import MethodSpec
    from commfuse.schedule import OPS

    torch.backends.cuda.matmul.allow_tf32 = False
    failed = {}
    for world in (2, 3, 4):
        for op in OPS:
            for method in ("decompose", "commfuse"):
                for topo in ("ring", "direct"):
                    for m in (1, 2):
                        spec = MethodSpec(method, topology=topo, splits=m)
                        err = _loopback_case(op, world, spec)
                        if err:
                            failed[f"W={world} {op} {method} {topo} m={m}"] = err
    report["loopback_failures"] = failed
    return f"{len(failed)} failed: {next(iter(failed.items()))}" if failed else None


# -- single rank, train, several GPUs ---------------------------------------------------------
def _single_rank(rank, world):
    from dist_cases import all_cases, run_cases

    from commfuse.ops.attention import query_split_attention

    cases = [c for c in all_cases() if c.dim == 0 or c.uneven]
    bad = {k: v for k, v in run_cases(rank, world, cases, "cuda").items() if v}
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
    from dist_cases import all_cases, run_cases

    from commfuse.testbed.spawn import run_local

    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        report["nccl"] = "skipped: 1 GPU (NCCL needs a GPU per rank)"
        return "skip"
    cases = [c for c in all_cases() if c.dtype == torch.float32 and (c.dim == 0 or c.uneven)]
    res = run_local(run_cases, world, cases, "cuda", backend="nccl", timeout=150, pg_timeout_s=60)
    bad = {c.id: [r[c.id] for r in res if r[c.id]] for c in cases}
    bad = {k: v for k, v in bad.items() if v}
    times = run_local(_bench, world, 8192, 4096, 10, backend="nccl", timeout=90)[0]
    report["nccl"] = {"world": world, "cases": len(cases), "failures": dict(list(bad.items())[:20]),
                      "ms_rank0": times}
    for k, v in times.items():
        print(f"    {k:<28} {v:8.3f} ms")
    return f"{len(bad)} of {len(cases)} failed, e.g. {next(iter(bad.items()))}" if bad else None


def _time(fn, iters=10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


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
        del a, b, y
    report["split_gemm"] = rows
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".", help="folder for gpu_check.json (default .)")
    p.add_argument("--only", nargs="+", choices=CHECKS, help="run only these checks")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build "
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
            err = globals()[f"check_{name}"](report)
        except Exception:
            err = traceback.format_exc()[-1500:]
        status = "SKIP" if err == "skip" else "FAIL" if err else "PASS"
        failed += status == "FAIL"
        report["checks"][name] = {"status": status, "error": err, "seconds": time.time() - t0}
        print(f"{status} {name} ({time.time() - t0:.1f} s){': ' + err if status == 'FAIL' else ''}",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"gpu_check: {failed} check(s) failed" if failed else "gpu_check: all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The checks of real NCCL P2P on one GPU and of what the CUDA path costs: a one-rank NCCL
group sending to itself through `CudaTransport`.

- ``nccl_p2p``: a batch of a send and a receive to itself: the exact bytes arrive, the batch
  is one work, the work is not complete right after posting while the compute stream is busy
  (the post did not wait), a wait with a deadline leaves the host free (the work still runs
  after it), and a warm post and wait make no host sync under
  ``torch.cuda.set_sync_debug_mode("error")``.
- ``overlap``: a slice GEMM (8192 x 4096 x 4096, bf16: a TP=4 slice of the paper's TPSP MLP)
  and the same slice's bytes (64 MiB) sent to itself, CUDA-event timed alone and together:
  the overlap fraction (t_gemm + t_comm - t_both) / min(t_gemm, t_comm), with the
  communication streams at high and at default priority.
- ``host_vs_gpu``: the host's time per fused op (its Python, posts and launches; no sync)
  against the GPU's, for the P2P methods on one rank that plays rank 0 of 2 with a self-loop
  (every transfer to "rank 1" goes to itself: the real posts, sizes and stream order), at a
  large and a small shape; the host's cost per post (what the GPU presets' ``host_p2p_s``
  estimates).
- ``memory``: 20 warm calls per op and method on 2 virtual ranks (`loopback`), with a
  deadline (the watchdog holds the works): allocated memory after each call must not grow;
  each method's peak against ``none``'s is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time

import torch

from commfuse.runtime.cuda import PRIORITY_ENV, Backend

SLICE = (8192, 4096, 4096)  # rows, K, N of the overlap check's slice GEMM


class SelfLoopBackend(Backend):
    """`commfuse.runtime.cuda.Backend` whose P2P batches go to this rank itself on ``real`` (a
    one-rank NCCL group), whatever peer the schedule names."""

    def __init__(self, real):
        super().__init__()
        self.real, self.posts = real, 0

    def issue(self, group, transfers):
        import torch.distributed as dist

        self.posts += 1
        me = dist.get_global_rank(self.real, 0)
        ops = [dist.P2POp(dist.isend if t.kind == "send" else dist.irecv, buf, me, self.real,
                          tag=t.tag) for t, buf in transfers]
        works = dist.batch_isend_irecv(ops)
        if len(works) != 1:
            raise AssertionError(f"NCCL returned {len(works)} works for one batch, not 1")
        return works[0]

    def launch(self, *args, **kw):
        raise NotImplementedError("the self-loop runs P2P methods only")


class SelfLoopGroup:
    """Rank 0 of ``world`` for the ops (size, rank), carrying a `SelfLoopBackend`."""

    def __init__(self, real, world: int = 2, backend: Backend | None = None):
        self.world, self.commfuse_backend = world, backend or SelfLoopBackend(real)

    def size(self) -> int:
        return self.world

    def rank(self) -> int:
        return 0


def events_ms(fn, iters: int = 10, warm: int = 3) -> float:
    """Median GPU time of ``fn`` (ms), CUDA events on the current stream."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def overlap_fraction(gemm_ms: float, comm_ms: float, both_ms: float) -> float:
    """How much of the shorter of the two hid behind the other: 1 = fully, 0 = none (clipped)."""
    hidden = gemm_ms + comm_ms - both_ms
    return max(0.0, min(1.0, hidden / min(gemm_ms, comm_ms))) if min(gemm_ms, comm_ms) > 0 else 0.0


def _pair(n: int, dtype=torch.bfloat16):
    from commfuse.schedule import Transfer

    send = torch.randn(n, device="cuda").to(dtype)
    recv = torch.empty_like(send)
    return [(Transfer("send", 0, 0, 0), send), (Transfer("recv", 0, 0, 0), recv)], send, recv


def _p2p(rank, world):
    """nccl_p2p on a one-rank NCCL group (spawned by `check_nccl_p2p`)."""
    import torch.distributed as dist

    from commfuse.runtime import deadlines
    from commfuse.runtime.cuda import CudaTransport

    real, out = dist.group.WORLD, {}
    backend = SelfLoopBackend(real)
    group = SelfLoopGroup(real, 1, backend)
    dev = torch.device("cuda", torch.cuda.current_device())
    transfers, send, recv = _pair(16 * 2 ** 20)  # 32 MiB
    torch.cuda._sleep(int(2e8))  # the compute stream busy for ~0.1 s: the batch waits for it
    t = CudaTransport(group, dev, None)
    works = t.post(transfers)
    out["one_work_per_batch"] = len({id(w) for w in works}) == 1
    out["pending_after_post"] = not works[0].is_completed()
    t.wait(works[0])
    torch.cuda.synchronize()
    out["exact"] = bool(torch.equal(send, recv))
    # with a deadline: the wait returns while the transfer still waits for the busy stream
    torch.cuda._sleep(int(2e8))
    t = CudaTransport(group, dev, 30.0)
    works = t.post(transfers)
    t0 = time.perf_counter()
    t.wait(works[0])
    out["deadline_wait_host_ms"] = 1e3 * (time.perf_counter() - t0)
    out["pending_after_deadline_wait"] = not works[0].is_completed()
    torch.cuda.synchronize()
    end = time.monotonic() + 2
    while deadlines.WATCHDOG.pending() and time.monotonic() < end:
        time.sleep(0.01)
    out["watchdog_released"] = deadlines.WATCHDOG.pending() == 0
    try:  # a warm op, with and without a deadline: no host sync
        torch.cuda.set_sync_debug_mode("error")
        for timeout in (None, 30.0):
            t = CudaTransport(group, dev, timeout)
            t.wait(t.post(transfers)[0])
        out["no_host_sync"] = True
    except RuntimeError as e:
        out["no_host_sync"] = f"{e}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return out


def check_nccl_p2p(report):
    from commfuse.testbed.spawn import run_local

    res = run_local(_p2p, 1, backend="nccl", timeout=120)[0]
    report["nccl_p2p"] = res
    bad = [k for k in ("one_work_per_batch", "pending_after_post", "exact",
                       "pending_after_deadline_wait", "watchdog_released", "no_host_sync")
           if res.get(k) is not True]
    return f"failed: {bad} ({res})" if bad else None


@contextlib.contextmanager
def _priority(high: bool):
    saved = os.environ.get(PRIORITY_ENV)
    os.environ[PRIORITY_ENV] = "1" if high else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(PRIORITY_ENV, None)
        else:
            os.environ[PRIORITY_ENV] = saved


def _overlap(rank, world):
    import torch.distributed as dist

    from commfuse.runtime.cuda import CudaTransport, comm_options

    rows, K, N = SLICE
    a = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
    transfers, _, _ = _pair(rows * K)  # the slice's bytes
    dev = torch.device("cuda", torch.cuda.current_device())
    out = {"shape": SLICE, "bytes": rows * K * 2}
    for high in (True, False):
        with _priority(high):
            real = dist.new_group([0], pg_options=comm_options("nccl"))
            group = SelfLoopGroup(real, 1, SelfLoopBackend(real))
            group.commfuse_backend.comm_stream(dev)  # made now, at this priority

        def comm():
            t = CudaTransport(group, dev, None)
            t.wait(t.post(transfers)[0])

        def both():
            t = CudaTransport(group, dev, None)
            works = t.post(transfers)  # the bytes travel while the GEMM runs
            torch.matmul(a, b, out=y)
            t.wait(works[0])

        gemm_ms = events_ms(lambda: torch.matmul(a, b, out=y))
        comm_ms, both_ms = events_ms(comm), events_ms(both)
        out["high" if high else "default"] = {
            "gemm_ms": gemm_ms, "comm_ms": comm_ms, "both_ms": both_ms,
            "overlap": overlap_fraction(gemm_ms, comm_ms, both_ms)}
    return out


def check_overlap(report):
    from commfuse.testbed.spawn import run_local

    res = run_local(_overlap, 1, backend="nccl", timeout=180)[0]
    report["overlap"] = res
    for k in ("high", "default"):
        r = res[k]
        print(f"    {k:>7} priority: GEMM {r['gemm_ms']:.3f} ms, transfer {r['comm_ms']:.3f} ms, "
              f"both {r['both_ms']:.3f} ms: overlap {r['overlap']:.0%}")
    best = res["high"]["overlap"]
    return None if best >= 0.2 else f"overlap {best:.0%} at high priority (< 20 %)"


def _host_vs_gpu(rank, world):
    import torch.distributed as dist

    from commfuse.check_gpu import loopback

    real, out = dist.group.WORLD, {}
    for s, k in ((32768, 4096), (512, 512)):  # rows per rank, K / 2 (K = 2k, N = k)
        for op in ("ag_matmul", "matmul_rs"):
            for label in ("commfuse-m1", "commfuse-m4", "decompose"):
                group = SelfLoopGroup(real)
                call, _ = loopback.make_case(op, 2, loopback.spec_of(label), "cuda", s=s, k=k,
                                             dtype=torch.bfloat16, uneven=False)
                for _ in range(3):
                    call(0, group)
                torch.cuda.synchronize()
                backend, n = group.commfuse_backend, 10
                backend.posts = 0
                host, start = [], torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(n):
                    t0 = time.perf_counter()
                    call(0, group)
                    host.append(time.perf_counter() - t0)
                end.record()
                end.synchronize()
                gpu_ms = start.elapsed_time(end) / n
                host_ms = 1e3 * statistics.median(host)
                posts = backend.posts / n
                out[f"{op} {label} s={s}"] = {
                    "host_ms": host_ms, "gpu_ms": gpu_ms, "posts": posts,
                    "host_per_post_us": 1e3 * host_ms / posts if posts else None}
    return out


def check_host_vs_gpu(report):
    from commfuse.testbed.spawn import run_local

    res = run_local(_host_vs_gpu, 1, backend="nccl", timeout=180)[0]
    report["host_vs_gpu"] = res
    for k, r in res.items():
        print(f"    {k:<32} host {r['host_ms']:7.3f} ms  GPU {r['gpu_ms']:7.3f} ms  "
              f"{r['posts']:.0f} posts, {r['host_per_post_us'] or 0:.0f} us host per post")
    per_post = [r["host_per_post_us"] for r in res.values() if r["host_per_post_us"]]
    report["host_per_post_us"] = statistics.median(per_post) if per_post else None
    slow = [k for k, r in res.items() if "s=32768" in k and r["host_ms"] >= r["gpu_ms"]]
    return f"host-bound at the large shape: {slow}" if slow else None


def memory_rows(op: str, labels, calls: int = 20, warm: int = 3) -> dict:
    """Per method: allocated bytes after each of ``calls`` warm calls of ``op`` on 2 virtual
    ranks with a deadline (the watchdog drained after each), and the peak above the start."""
    from commfuse.check_gpu import loopback
    from commfuse.runtime import deadlines

    rows = {}
    for label in labels:
        spec = dataclasses.replace(loopback.spec_of(label), timeout=30.0)
        call, _ = loopback.make_case(op, 2, spec, "cuda", s=1024, k=256)
        after = []
        for i in range(warm + calls):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loopback.run(call, 2)
            torch.cuda.synchronize()
            end = time.monotonic() + 2
            while deadlines.WATCHDOG.pending() and time.monotonic() < end:
                time.sleep(0.005)
            if i >= warm:
                after.append(torch.cuda.memory_allocated())
            peak = torch.cuda.max_memory_allocated() - base
        rows[label] = {"growth_bytes": after[-1] - after[0], "peak_bytes": peak}
    return rows


def check_memory(report):
    from commfuse.schedule import OPS

    labels = ("none", "sliced", "decompose", "commfuse", "commfuse-m4", "commfuse-direct")
    res, grew = {}, []
    for op in OPS:
        rows = memory_rows(op, labels)
        for label, r in rows.items():
            r["peak_vs_none"] = r["peak_bytes"] / max(rows["none"]["peak_bytes"], 1)
            if r["growth_bytes"] > 0:
                grew.append(f"{op} {label}: +{r['growth_bytes']} B")
        res[op] = rows
    report["memory"] = res
    return f"memory grew over 20 warm calls: {grew}" if grew else None

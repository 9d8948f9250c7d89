"""The loopback check: W virtual ranks in one process on one GPU, each a thread with its own
compute stream, running every op's P2P schedules through `CudaTransport` with a backend that
copies each send into its receive on a side stream (NCCL refuses two ranks on one GPU)."""

from __future__ import annotations

import threading
import traceback

import torch

DEVICE = "cuda"


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

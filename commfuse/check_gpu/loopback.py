"""The loopback check: W virtual ranks in one process (NCCL refuses two ranks on one GPU), each
a daemon thread, running every op under every method through `CudaTransport`, its batches and
collectives matched as NCCL matches them (`commfuse.runtime.nccl_model`: one stream per rank,
pairs in issue order, tags ignored). On a GPU each rank computes on its own stream and every
copy runs on a side stream after both sides' streams (`SideStreamMover`); on CPU
(``tests/test_nccl_order.py``) the same cases run with host copies. Inputs are small integers,
so every result is exact: it must equal the unsharded GEMM's bit for bit."""

from __future__ import annotations

import torch

from commfuse.runtime import virtual_ranks

DEVICE = "cuda"
# every named variant but auto (a choice among them), and decompose over the direct topology
VARIANT_LABELS = ("none", "none-torch", "sliced", "decompose", "decompose-direct", "commfuse",
                  "commfuse-m1", "commfuse-m2", "commfuse-m4", "commfuse-m8", "commfuse-direct")


class SideStreamMover:
    """`commfuse.runtime.nccl_model`'s data movement on one GPU: a batch waits for the stream
    current at its issue (NCCL's rule), each copy runs on a side stream after both sides'."""

    def __init__(self):
        self.side = torch.cuda.Stream()

    def mark(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def run(self, fn, readies, tensors):
        for e in readies:
            self.side.wait_event(e)
        with torch.cuda.stream(self.side):
            fn()
        for t in tensors:
            t.record_stream(self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def query(self, done) -> bool:
        return done.query()

    def after(self, dones) -> None:
        for e in dones:
            torch.cuda.current_stream().wait_event(e)


def spec_of(label: str):
    from commfuse.ops.methods import method_spec
    from commfuse.schedule import VARIANTS

    if label == "decompose-direct":
        return method_spec("decompose", {"topology": "direct"})
    return method_spec(*VARIANTS[label])


def case(op: str, world: int, spec, device: str = DEVICE, timeout_s: float = 60.0):
    """Run ``op`` under ``spec`` on ``world`` virtual ranks; None, or what differs."""
    call, ref = make_case(op, world, spec, device)
    return compare(run(call, world, device, timeout_s), ref)


def make_case(op: str, world: int, spec, device: str = DEVICE, s: int = 24, k: int = 12,
              dtype=torch.float32, uneven: bool = True):
    """``(call(rank, group), the unsharded results)`` of ``op`` under ``spec`` on ``world``
    ranks, slices of ``s`` rows (``uneven``: every other one 5 more), K = ``k`` * world,
    N = K / 2 (``k`` even)."""
    from commfuse.ops import ag_matmul, all_to_all, matmul_rs

    K, N = k * world, k * world // 2
    g = torch.Generator().manual_seed(world)
    rnd = lambda *shape: torch.randint(-3, 4, shape, generator=g).to(device, dtype)  # noqa: E731
    sizes = tuple(s + 5 * (p % 2) * uneven for p in range(world))
    S, offs = sum(sizes), [sum(sizes[:p]) for p in range(world)]
    if op == "ag_matmul":
        a, b = [rnd(n, K) for n in sizes], [rnd(K, N) for _ in range(world)]
        ref = [torch.cat(a) @ b[r] for r in range(world)]
        call = lambda r, grp: ag_matmul.ag_matmul(a[r], [b[r]], sizes, grp, spec)[1][0]  # noqa: E731
    elif op == "matmul_rs":
        x, b = [rnd(S, K) for _ in range(world)], [rnd(K, N) for _ in range(world)]
        tot = sum(x[r] @ b[r] for r in range(world))
        ref = [tot[offs[r]:offs[r] + sizes[r]] for r in range(world)]
        call = lambda r, grp: matmul_rs.matmul_rs([(x[r], b[r])], None, sizes, grp, spec)  # noqa: E731
    elif op == "matmul_a2a":
        a, B, n = [rnd(n, K) for n in sizes], rnd(K, N), N // world
        y = torch.cat(a) @ B
        ref = [y[:, r * n:(r + 1) * n] for r in range(world)]
        call = lambda r, grp: all_to_all.matmul_a2a(a[r], B, sizes, grp, spec)  # noqa: E731
    else:
        k = K // world
        a, B = [rnd(S, k) for _ in range(world)], rnd(world * k, N)
        x = torch.cat(a, -1) @ B
        ref = [x[offs[r]:offs[r] + sizes[r]] for r in range(world)]
        call = lambda r, grp: all_to_all.a2a_matmul(a[r], B, sizes, grp, spec)[0]  # noqa: E731
    return call, ref


def run(call, world: int, device: str = DEVICE, timeout_s: float = 60.0) -> list:
    """``[call(rank, group)]`` on ``world`` virtual ranks; on a GPU each rank on its own
    compute stream, synchronised before it returns."""
    if device == "cpu":
        return virtual_ranks.run_ranks(world, lambda grp: call(grp.rank(), grp), timeout_s)
    torch.cuda.synchronize()

    def rank_main(grp):
        with torch.cuda.stream(torch.cuda.Stream()):  # this virtual rank's compute stream
            out = call(grp.rank(), grp)
            torch.cuda.current_stream().synchronize()
        return out

    return virtual_ranks.run_ranks(world, rank_main, timeout_s, device, SideStreamMover())


def compare(outs, ref) -> str | None:
    bad = [r for r in range(len(ref)) if not torch.equal(outs[r], ref[r])]
    return f"ranks {bad} differ from the unsharded result" if bad else None


def check_loopback(report, device: str = DEVICE):
    """Every op under every variant on 2, 3, 4 virtual ranks, exact (``device`` "cpu": host
    copies, `commfuse.runtime.nccl_model.CpuMover`: what runs where no GPU is)."""
    from commfuse.schedule import OPS

    torch.backends.cuda.matmul.allow_tf32 = False
    failed = {}
    for world in (2, 3, 4):
        for op in OPS:
            for label in VARIANT_LABELS:
                try:
                    err = case(op, world, spec_of(label), device)
                except Exception as e:  # a deadlock, a mismatch, a timeout: named, not hung
                    err = f"{type(e).__name__}: {str(e)[-800:]}"
                if err:
                    failed[f"W={world} {op} {label}"] = err
    report["loopback_cases"] = 3 * len(OPS) * len(VARIANT_LABELS)
    report["loopback_failures"] = failed
    return f"{len(failed)} failed: {next(iter(failed.items()))}" if failed else None

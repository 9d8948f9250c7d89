"""Extra memory of each op and method: the peak of the process's allocated bytes during one
call, beyond its inputs and outputs (receive buffers, partial results, chunk buffers).

Measured with glibc's ``mallinfo2`` (bytes in use: heap plus mmap'd blocks, where tensors of
this size live), sampled after every GEMM, post and wait of the schedule, and at the end: the
peak of the samples minus the bytes in use before the call, minus the op's output. Small
allocations of other threads (gloo) are noise at the sizes measured. ``python -m commfuse.bench.memory``
prints the table; `bound` is the README's memory table, which the tests check it against.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

import torch

from commfuse.schedule import OPS, VARIANTS

# what the memory table measures: every fixed method variant, and sliced with 2 chunks
MEASURED = {**{v: VARIANTS[v] for v in VARIANTS if v != "auto"},
            "sliced-2": ("sliced", {"chunks": 2})}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
AVAILABLE = hasattr(_libc, "mallinfo2")  # glibc >= 2.33
if AVAILABLE:
    _libc.mallinfo2.restype = _MallInfo2


def in_use() -> int:
    """Bytes allocated by malloc in this process (heap and mmap'd chunks)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


@contextlib.contextmanager
def _sampling(samples: list[int]):
    """Sample `in_use` after every GEMM, transfer post and wait of the executor."""
    from commfuse.runtime import modes
    from commfuse.runtime.transport import Transport

    real = modes.gemm, Transport.post, Transport.wait

    def sampled(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            samples.append(in_use())
            return out
        return call

    modes.gemm, Transport.post, Transport.wait = map(sampled, real)
    try:
        yield
    finally:
        modes.gemm, Transport.post, Transport.wait = real


def peak_bytes(fn) -> tuple[int, object]:
    """(peak bytes in use during ``fn()`` beyond those in use before it, its result)."""
    samples: list[int] = []
    gc.collect()  # garbage of earlier calls must not be freed (and counted negative) in this one
    base = in_use()
    with _sampling(samples):
        out = fn()
    samples.append(in_use())
    return max(samples) - base, out


def call(op: str, world: int, rows: int, k: int, n: int, method: str, opts: dict):
    """``op``'s forward on random inputs, as the op's autograd forward runs it (the internal
    function: an autograd.Function would hide when its frees happen from the profiler): one
    rank's slice of ``rows`` rows, K = ``k``, ``n`` columns of one rank's output."""
    import torch.distributed as dist

    from commfuse.ops.ag_matmul import ag_matmul
    from commfuse.ops.all_to_all import a2a_matmul, matmul_a2a
    from commfuse.ops.matmul_rs import matmul_rs
    from commfuse.ops.methods import method_spec

    group = dist.group.WORLD
    spec = method_spec(method, opts)
    sizes = (rows,) * world
    if op == "ag_matmul":
        a, b = torch.randn(rows, k), torch.randn(k, n)
        return lambda: ag_matmul(a, [b], sizes, group, spec)[1]
    if op == "matmul_rs":
        a, b = torch.randn(world * rows, k), torch.randn(k, n)
        return lambda: matmul_rs([(a, b)], None, sizes, group, spec)
    if op == "matmul_a2a":
        a, b = torch.randn(rows, k), torch.randn(k, world * n)
        return lambda: matmul_a2a(a, b, sizes, group, spec)
    a, b = torch.randn(world * rows, k), torch.randn(world * k, n)
    return lambda: a2a_matmul(a, b, sizes, group, spec)[0]


def sizes_of(op: str, world: int, rows: int, k: int, n: int) -> dict[str, int]:
    """Element counts of the tensors the bounds are stated in (see `bound`)."""
    S = world * rows
    return {"A": S * k, "Y": S * n, "C": rows * n, "X": rows * world * k,
            "Ya": rows * n}  # Ya: a2a->GEMM's output [s, N]


def bound(op: str, method: str, opts: dict, world: int, t: dict) -> float:
    """The documented extra memory of one forward call, in elements (README, "Extra memory").

    AG->GEMM: A = the gathered input [S, K], Y = the output [S, N]. GEMM->RS: C = this
    rank's output [s, N]. GEMM->a2a: Y = the output [S, N/W]. a2a->GEMM: X = the exchanged
    input [s, W*k], Ya = the output [s, N]. W ranks, k chunks (sliced), m splits.
    """
    W, k, m = world, opts.get("chunks", 4), opts.get("splits", 1)
    direct = opts.get("topology") == "direct"
    # torch's own collective (collective="backend") may copy what it moves once more: gloo's
    # reduce-scatter always did, its all-to-all sometimes
    backend = opts.get("collective") == "backend"
    moved = {"ag_matmul": t["A"], "matmul_rs": W * t["C"], "matmul_a2a": t["Y"], "a2a_matmul": t["X"]}
    return _bound(op, method, W, k, m, direct, t) + (moved[op] if backend else 0)


def _bound(op: str, method: str, W: int, k: int, m: int, direct: bool, t: dict) -> float:
    if op == "ag_matmul":
        return t["A"] + (2 * t["A"] + t["Y"]) / k if method == "sliced" else t["A"]
    if op == "matmul_rs":
        return (2 * W - 1) * t["C"] if method in ("none", "sliced") or direct else (W + 1 / m) * t["C"]
    if op == "matmul_a2a":
        return {"none": 1, "sliced": 2}.get(method, (W - 1) / W) * t["Y"]
    if method in ("none", "sliced"):
        return t["X"] * (1 + (method == "sliced") / k)
    return (W - 1) / W * t["X"] + t["Ya"] / m


def measure(rank: int, world: int, variants: dict, rows: int = 256, k: int = 256,
            n: int = 512) -> dict:
    """Per (op, variant label): measured extra bytes and the documented bound (every rank)."""
    out = {}
    with torch.no_grad():
        for op in OPS:
            t = sizes_of(op, world, rows, k, n)
            for label, (method, opts) in variants.items():
                fn = call(op, world, rows, k, n, method, opts)
                fn()  # warm-up: lazily created state (sender threads, auto's cache)
                peak, res = peak_bytes(fn)
                res = res if isinstance(res, (list, tuple)) else [res]
                own = sum(x.numel() * x.element_size() for x in res)
                out[(op, label)] = {"extra_bytes": peak - own,
                                    "bound_bytes": bound(op, method, opts, world, t) * 4}
    return out


def main(argv=None) -> int:
    import argparse

    from commfuse.testbed.spawn import run_local

    p = argparse.ArgumentParser(prog="python -m commfuse.bench.memory",
                                description="Measured extra memory of every op and method "
                                            "(float32, local gloo ranks) against the bound.")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--rows", type=int, default=1024, help="rows of one rank's slice")
    p.add_argument("--k", type=int, default=512, help="contraction K (default 512)")
    p.add_argument("--n", type=int, default=1024, help="output columns N (default 1024)")
    a = p.parse_args(argv)
    res = run_local(measure, a.world, MEASURED, a.rows, a.k, a.n, timeout=600)
    print(f"extra memory per call, MiB (W={a.world}, slice {a.rows} rows, K={a.k}, N={a.n}; "
          "worst rank)\n| op | variant | measured | bound |\n|---|---|---|---|")
    for key in res[0]:
        worst = max(r[key]["extra_bytes"] for r in res)
        print(f"| {key[0]} | {key[1]} | {worst / 2**20:.2f} | "
              f"{res[0][key]['bound_bytes'] / 2**20:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run a function on N local ranks (real processes on gloo), for tests, the demo and training.

Rendezvous is a `FileStore` in a fresh temporary directory: no fixed port, no race with other
runs. Results come back per rank; an exception on any rank is re-raised in the parent with
that rank's traceback, and a run that exceeds ``timeout`` is killed, never left hanging.

Each rank is a new process per call (nothing one call leaves behind reaches the next), forked
by default from a server process that imported torch and commfuse once, when the first call
started it: a rank then starts in tens of milliseconds where a fresh interpreter takes 2-6 s
to import torch (with torch._dynamo, which auto's choices import) on this project's 2-core
machines. The server never runs torch work itself, so a fork inherits no thread pool, and a
forked rank gets the caller's environment, standard output and error as they are at the call,
as a fresh interpreter does. ``start_ranks("spawn")`` starts every rank as a fresh interpreter.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from multiprocessing import reduction
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commfuse.runtime.gloo import duplex

PRELOAD = ("torch", "torch.distributed", "commfuse.ops.registry", "commfuse.runtime.gloo",
           "commfuse.testbed.spawn")  # what the fork server imports: every rank needs these
_START = {"method": "forkserver", "preload": PRELOAD}


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def start_ranks(method: str = "forkserver", preload: tuple[str, ...] = ()) -> None:
    """How the later `run_local` calls of this process start their ranks: "forkserver" forks
    each from the server, which imports `PRELOAD` and ``preload`` (module names, found on
    ``sys.path`` as it is when the server starts: at the first call); "spawn" starts each as a
    fresh interpreter."""
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"method must be 'forkserver' or 'spawn', got {method!r}")
    _START.update(method=method, preload=tuple(dict.fromkeys(PRELOAD + tuple(preload))))


class _Inherit:
    """One of the caller's file descriptors, handed to a forked rank when it is started (the
    fork server's own descriptors are those of whoever started the server)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _inherited_fd, (reduction.DupFd(self.fd),)


def _inherited_fd(dup) -> int:
    return dup.detach()


def _caller() -> tuple | None:
    """What a forked rank takes from the caller: its environment, stdout and stderr."""
    if _START["method"] != "forkserver":
        return None  # a fresh interpreter inherits them itself

    def fd(n: int) -> _Inherit | None:
        try:
            os.fstat(n)
        except OSError:  # closed in the caller: the rank keeps the server's
            return None
        return _Inherit(n)

    return dict(os.environ), fd(1), fd(2)


def _worker(rank: int, world: int, store_path: str, fn: Callable, args: tuple, results,
            threads: int, pg_timeout_s: float, backend: str, caller: tuple | None = None) -> None:
    if caller is not None:
        env, *fds = caller
        os.environ.clear()
        os.environ.update(env)
        for n, fd in enumerate(fds, 1):
            if fd is not None:
                os.dup2(fd, n)
                os.close(fd)
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s),
                                pg_options=pg_options(backend))
        duplex()  # one connection per direction between two ranks (commfuse.runtime.gloo)
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def pg_options(backend: str):
    """The ``pg_options`` of a group commfuse creates: high-priority NCCL streams
    (`commfuse.runtime.cuda.comm_options`); None on gloo."""
    if backend != "nccl":
        return None
    from commfuse.runtime.cuda import comm_options  # CUDA-only code, imported lazily

    return comm_options(backend)


def run_local(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0,
              threads: int = 1, pg_timeout_s: float = 60.0, backend: str = "gloo",
              victims: tuple[int, ...] = ()) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each rank in its own process.

    ``fn`` must be importable (a module-level function). ``threads`` sets each rank's
    intra-op threads; with ``backend="nccl"`` rank i uses GPU i mod the GPU count. Raises
    `RankFailed` if a rank raises, `TimeoutError` after ``timeout``. ``victims`` (fault
    injection) may die, hang or raise: the run returns once every other rank has reported,
    with None for a victim that has not (it is then killed).
    """
    if _START["method"] == "forkserver":
        mp.set_forkserver_preload(list(_START["preload"]))  # read when the server starts
    ctx = mp.get_context(_START["method"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="commfuse-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, store, fn, args, results, threads, pg_timeout_s,
                                   backend, _caller()))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout, set(victims))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _collect(procs, results, world_size: int, timeout: float, victims: set[int]) -> list[Any]:
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    outs: dict[int, Any] = {}
    needed = set(range(world_size)) - victims
    while not needed <= set(outs):
        left = (deadline - datetime.datetime.now()).total_seconds()
        if left <= 0:
            raise TimeoutError(f"ranks {sorted(needed - set(outs))} did not "
                               f"finish within {timeout:.0f} s")
        try:
            rank, ok, out = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i in needed - set(outs)]
            if dead and results.empty():
                codes = {i: procs[i].exitcode for i in dead}
                raise RankFailed(f"rank(s) {dead} died without reporting (exit codes {codes})")
            continue
        if not ok and rank not in victims:
            raise RankFailed(f"rank {rank} failed:\n{out}")
        outs[rank] = out if ok else None
    return [outs.get(r) for r in range(world_size)]

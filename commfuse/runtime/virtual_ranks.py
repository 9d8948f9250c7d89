"""Virtual ranks: threads of one process that run the real ops over one
`commfuse.runtime.nccl_model.Communicator`, as NCCL would match them.

`VirtualGroup` is what the ops read of a group (``size``, ``rank``) and carries a
`VirtualBackend` (``commfuse_backend``), so `commfuse.runtime.modes` runs the ops through
`commfuse.runtime.cuda.CudaTransport`, whose batches and collectives go to the communicator;
on CPU its stream calls are no-ops. `run_ranks` runs one function per virtual rank, each on a
daemon thread (a rank that hangs never holds up the process's exit).
"""

from __future__ import annotations

import contextlib
import threading
import time

from commfuse.runtime.cuda import Backend
from commfuse.runtime.nccl_model import TIMEOUT_S, Communicator, Deadlock, Op


class VirtualBackend(Backend):
    """`commfuse.runtime.cuda.Backend` whose NCCL calls go to a `Communicator`; the stream
    calls are CUDA's (a GPU loopback), or no-ops where ``device`` is the CPU."""

    def __init__(self, comm: Communicator, rank: int, device: str = "cpu"):
        super().__init__()
        self.comm, self.rank, self.cpu = comm, rank, device == "cpu"

    def comm_stream(self, device):
        return None if self.cpu else super().comm_stream(device)

    def current_stream(self, device):
        return None if self.cpu else super().current_stream(device)

    def use(self, stream):
        return contextlib.nullcontext() if self.cpu else super().use(stream)

    def record_event(self, stream):
        return None if self.cpu else super().record_event(stream)

    def wait_event(self, stream, event) -> None:
        if not self.cpu:
            super().wait_event(stream, event)

    def issue(self, group, transfers) -> Op:
        return self.comm.issue(self.rank, transfers)

    def launch(self, group, kind, out, inp, tag, policy, **parts) -> Op:
        if policy == "p2p":
            raise NotImplementedError("the NCCL model runs the backend's collectives "
                                      "(collective='auto' or 'backend'), not 'p2p'")
        if kind == "all_reduce" and out is not inp:
            out.copy_(inp)
        return self.comm.collective(self.rank, kind, out, inp, **parts)


class VirtualGroup:
    """What the ops read of a process group (size, rank), carrying the rank's backend."""

    def __init__(self, comm: Communicator, rank: int, device: str = "cpu"):
        self.comm, self.r = comm, rank
        self.commfuse_backend = VirtualBackend(comm, rank, device)

    def size(self) -> int:
        return self.comm.world

    def rank(self) -> int:
        return self.r


def run_ranks(world: int, fn, timeout_s: float = TIMEOUT_S, device: str = "cpu", mover=None):
    """``[fn(group) for each rank]``, every rank on its own daemon thread over one
    `Communicator`. The first error is raised, a rank's own before the `Deadlock` it left
    its peers in; a rank still running after ``timeout_s`` raises `TimeoutError` (its thread
    is a daemon, so it never holds up the process's exit)."""
    comm = Communicator(world, timeout_s, mover)
    outs: list = [None] * world
    errors: list[tuple[int, BaseException]] = []

    def main(r: int) -> None:
        try:
            outs[r] = fn(VirtualGroup(comm, r, device))
        except BaseException as e:  # handed to the caller
            errors.append((r, e))
        finally:
            comm.rank_returned(r)

    threads = [threading.Thread(target=main, args=(r,), name=f"commfuse-virtual-rank-{r}",
                                daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout_s + 1  # a grace for the ranks ending at their waits
    for t in threads:
        t.join(max(end - time.monotonic(), 0))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if errors:
        errors.sort(key=lambda e: _is_deadlock(e[1]))
        raise errors[0][1]
    if alive:
        raise TimeoutError(f"NCCL model: ranks {alive} still running after {timeout_s:g} s")
    return outs


def _is_deadlock(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, Deadlock):
            return True
        e = e.__cause__
    return False

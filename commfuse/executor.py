"""Run a schedule (`commfuse.schedule`) on a process group.

The executor walks the steps in order and delegates the tensors to a *binding*, the op's
object that knows which buffer a slot is and how to compute it:

    binding.buffer(transfer) -> Tensor    # what a send reads / a receive writes
    binding.compute(slot)                 # the partial GEMM of that slot
    binding.reduce(slot, peers)           # sum received partials in that order
    binding.collective(slot, transport)   # start the op's collective on a chunk -> work
    binding.collective_done(slot)         # after its wait: place the chunk's result

Transports post the transfers. On CPU (gloo) ``isend``/``irecv`` run on the backend's own
threads while this thread runs the GEMMs. On CUDA (`commfuse._cuda`) they run on a dedicated
communication stream ordered with events, so GEMMs on the compute stream overlap them.
Every wait has a deadline: a dead or stalled peer raises `CommFuseError` naming the op, step
and peer instead of hanging.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commfuse.errors import CommFuseError
from commfuse.schedule import (Collective, Compute, Post, Reduce, Schedule, Transfer, Wait,
                               WaitCollective)

DEFAULT_TIMEOUT_S = 600.0  # used when the group's own timeout cannot be read


class Binding(Protocol):
    def buffer(self, transfer: Transfer) -> torch.Tensor: ...
    def compute(self, slot: int) -> None: ...
    def reduce(self, slot: int, peers: tuple[int, ...]) -> None: ...
    def collective(self, slot: int, transport: "Transport") -> Any: ...
    def collective_done(self, slot: int) -> None: ...


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> float:
    """The process group's own timeout in seconds (what its collectives would use)."""
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # backends without readable options
        return DEFAULT_TIMEOUT_S


class Transport:
    """Posts transfers and collectives for one op call and waits on them with a deadline."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float):
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)

    def post(self, transfers: list[tuple[Transfer, torch.Tensor]]) -> list[Any]:
        ops = []
        for t, buf in transfers:
            fn = dist.isend if t.kind == "send" else dist.irecv
            peer = dist.get_global_rank(self.group, t.peer)
            ops.append(dist.P2POp(fn, buf, peer, self.group, tag=t.tag))
        works = dist.batch_isend_irecv(ops)
        # one work per transfer on gloo; a single work for the whole batch on NCCL
        return works if len(works) == len(ops) else [works[0]] * len(ops)

    def launch(self, fn, *args, **kwargs) -> Any:
        """Start an async collective ``fn(*args, group=..., async_op=True)``."""
        return fn(*args, group=self.group, async_op=True, **kwargs)

    def wait(self, work: Any) -> None:
        work.wait(self.timeout)  # bounded: a bare wait() on gloo P2P can outlive the group timeout


def make_transport(group: dist.ProcessGroup, device: torch.device, timeout_s: float | None):
    timeout_s = group_timeout(group, device) if timeout_s is None else timeout_s
    if device.type == "cuda":
        from commfuse._cuda import CudaTransport  # CUDA-only code, imported lazily

        return CudaTransport(group, device, timeout_s)
    return Transport(group, device, timeout_s)


def run(schedule: Schedule, binding: Binding, transport: Transport) -> None:
    """Execute ``schedule`` step by step; raise `CommFuseError` if a transfer fails or stalls."""
    pending: dict[Any, Any] = {}  # transfer or ("collective", slot) -> work
    done: dict[int, Any] = {}  # works already waited (kept alive so ids stay unique):
    # never wait twice on one work (a batch may share one work; a double wait hung gloo)
    for index, step in enumerate(schedule.steps):
        if isinstance(step, Compute):
            binding.compute(step.slot)
        elif isinstance(step, Post):
            try:
                works = transport.post([(t, binding.buffer(t)) for t in step.transfers])
            except Exception as e:
                raise _error(schedule, index, step.transfers[0], e) from e
            pending.update(zip(step.transfers, works))
        elif isinstance(step, Wait):
            _wait(pending.pop(step.transfer), done, transport, schedule, index, step.transfer)
        elif isinstance(step, Reduce):
            binding.reduce(step.slot, step.peers)
        elif isinstance(step, Collective):
            pending[("collective", step.slot)] = binding.collective(step.slot, transport)
        elif isinstance(step, WaitCollective):
            work = pending.pop(("collective", step.slot))
            _wait(work, done, transport, schedule, index, None)
            binding.collective_done(step.slot)
    assert not pending, f"schedule left transfers unwaited: {list(pending)}"


def _wait(work, done: dict[int, Any], transport: Transport, schedule: Schedule, index: int,
          transfer: Transfer | None) -> None:
    if id(work) in done:
        return
    done[id(work)] = work
    try:
        transport.wait(work)
    except Exception as e:
        raise _error(schedule, index, transfer, e) from e


def _error(schedule: Schedule, index: int, transfer: Transfer | None, cause: Exception):
    where = (f"{transfer.kind} of slot {transfer.slot} "
             f"{'to' if transfer.kind == 'send' else 'from'} rank {transfer.peer}"
             if transfer else "the collective")
    return CommFuseError(
        f"commfuse {schedule.op} (method={schedule.method}, rank {schedule.rank} of "
        f"{schedule.world_size}) failed at step {index} waiting for {where}: {cause}")

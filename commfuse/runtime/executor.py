"""Run a schedule (`commfuse.schedule`) on a process group.

The executor walks the steps in order and delegates the tensors to a *binding*, the op's
object that knows which buffer a slot is and how to compute it:

    binding.buffer(transfer) -> Tensor    # what a send reads / a receive writes
    binding.compute(slot)                 # the partial GEMM of that slot
    binding.reduce(slot, peers)           # sum received partials in that order
    binding.collective(slot, transport)   # start the op's collective on a chunk -> work
    binding.collective_done(slot)         # after its wait: place the chunk's result

A *transport* (`commfuse.runtime.transport`) posts the transfers. On CPU (gloo) ``isend`` /
``irecv`` run on the backend's own threads while this thread runs the GEMMs. On CUDA
(`commfuse.runtime.cuda`) they are issued from a communication stream that waits only for
each batch's own data (``transport.produced(slot)`` after each Compute/Reduce records it,
where the op's sends carry what its computes wrote: not `SENDS_INPUT`'s), so
GEMMs on the compute stream overlap them; the op's receive buffers are allocated before the
transport begins. Every wait has a deadline (on CUDA when a timeout is given, kept by a
watchdog thread, not the host; else NCCL's watchdog): a dead or stalled peer raises
`CommFuseError` naming the op, step and peer instead of hanging. The measurement modes
(`commfuse.runtime.modes`) pick the transport and a `commfuse.trace.Tracer` receives the spans
of a traced run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commfuse.errors import CommFuseError
from commfuse.runtime import modes
from commfuse.runtime.transport import Done, Transport, TransferFailed
from commfuse.schedule import (SENDS_INPUT, Collective, Compute, Post, Reduce, Schedule,
                               Transfer, Wait, WaitCollective)
from commfuse.schedule.prefetch import last_post
from commfuse.trace import Tracer


class Binding(Protocol):
    def buffer(self, transfer: Transfer) -> torch.Tensor: ...
    def compute(self, slot: int) -> None: ...
    def reduce(self, slot: int, peers: tuple[int, ...]) -> None: ...
    def collective(self, slot: int, transport: "Transport") -> Any: ...
    def collective_done(self, slot: int) -> None: ...


def make_transport(group: dist.ProcessGroup, device: torch.device, timeout_s: float | None,
                   collective: str = "auto") -> Transport:
    """The transport of one op call: the mode's (`commfuse.runtime.modes`), else CUDA's or
    gloo's; ``timeout_s`` None means the group's own timeout (on CUDA: NCCL's watchdog, no
    host-side deadline)."""
    return modes.transport_class(device, group)(group, device, timeout_s, collective)


def run(schedule: Schedule, binding: Binding, transport: Transport, after_posts=None) -> None:
    """Execute ``schedule`` step by step; raise `CommFuseError` if a transfer fails or stalls.
    ``after_posts()``, if given, runs once right after the schedule's last Post / Collective
    (`commfuse.schedule.prefetch.last_post`): the point where a following op's prefetch is posted
    without queueing ahead of any of this op's own transfers."""
    execution = Execution(schedule, binding, transport)
    last = last_post(schedule)
    if after_posts is None or last is None:
        execution.run(range(len(schedule.steps)))
    else:
        execution.run(range(last + 1))
        after_posts()
        execution.run(range(last + 1, len(schedule.steps)))
    execution.close()


class Execution:
    """One schedule being executed, possibly in parts (`run` on some of its step indices,
    later on the rest): the works posted so far stay pending between the parts, each waited
    once, with the transport's deadline (`commfuse.ops.prefetch` posts a gather's early steps
    in one op's backward and runs the rest in the next)."""

    def __init__(self, schedule: Schedule, binding: Binding, transport: Transport):
        self.schedule, self.binding, self.transport = schedule, binding, transport
        self.pending: dict[Any, _Handle] = {}  # transfer or ("collective", slot) -> work
        self.posted_at: dict[Any, float] = {}
        # CUDA: every receive buffer allocated now, on the compute stream, and the transport
        # begun after them (`commfuse.runtime.cuda`: no batch writes memory a queued GEMM reads)
        self.received: dict[Transfer, torch.Tensor] = {}
        if getattr(transport, "preallocates", False):
            self.received = {t: binding.buffer(t) for step in schedule.steps
                             if isinstance(step, Post) for t in step.transfers
                             if t.kind == "recv"}
            transport.begin()

    def run(self, indices) -> None:
        """Run the steps at ``indices`` (in that order)."""
        binding, transport, schedule = self.binding, self.transport, self.schedule
        pending, posted_at = self.pending, self.posted_at
        tracer = modes.tracer()
        op = schedule.op
        produces = op not in SENDS_INPUT  # whether a send waits for its slot's Compute
        for index in indices:
            step = schedule.steps[index]
            t0 = time.perf_counter()
            if isinstance(step, Compute):
                binding.compute(step.slot)
                if produces:
                    transport.produced(step.slot)
            elif isinstance(step, Post):
                try:
                    bufs = [(t, self.received.pop(t) if t in self.received else binding.buffer(t))
                            for t in step.transfers]
                    # empty slices (more ranks than rows) move nothing: both sides know the
                    # sizes, and a batch with nothing left is not posted (NCCL refuses it)
                    live = [(t, b) for t, b in bufs if b.numel()]
                    works = iter(transport.post(live) if live else ())
                    works = [next(works) if b.numel() else Done() for _, b in bufs]
                except TransferFailed as e:  # the transport names the transfer it could not post
                    raise _error(schedule, index, e.transfer, e.__cause__ or e) from e
                except Exception as e:
                    raise _error(schedule, index, step.transfers[0], e) from e
                handles: dict[int, _Handle] = {}  # a batch may share one work (NCCL): one handle
                pending.update((t, handles.setdefault(id(w), _Handle(w)))
                               for t, w in zip(step.transfers, works))
                posted_at.update((t, t0) for t in step.transfers)
            elif isinstance(step, Wait):
                _wait(pending.pop(step.transfer), transport, schedule, index, step.transfer)
            elif isinstance(step, Reduce):
                binding.reduce(step.slot, step.peers)
                transport.produced(step.slot)
            elif isinstance(step, Collective):
                try:
                    pending[("collective", step.slot)] = _Handle(
                        binding.collective(step.slot, transport))
                except Exception as e:
                    raise _error(schedule, index, None, e) from e
                posted_at[("collective", step.slot)] = t0
            elif isinstance(step, WaitCollective):
                work = pending.pop(("collective", step.slot))
                _wait(work, transport, schedule, index, None)
                binding.collective_done(step.slot)
            if tracer is not None:
                _trace(tracer, op, step, t0, time.perf_counter(), posted_at)

    def drain(self) -> None:
        """Wait for every work still pending, in posting order (each once, with the deadline),
        and drop them: an abandoned execution leaves nothing in flight."""
        while self.pending:
            key, handle = next(iter(self.pending.items()))
            del self.pending[key]
            _wait(handle, self.transport, self.schedule, -1,
                  key if isinstance(key, Transfer) else None)

    def close(self) -> None:
        assert not self.pending, f"schedule left transfers unwaited: {list(self.pending)}"


def _trace(tracer: Tracer, op: str, step, t0: float, t1: float, posted_at: dict) -> None:
    """Compute spans on the compute track; a transfer spans from its post to its wait's end,
    on a track per kind and peer ("send to 1"); waits that blocked on the wait track."""
    if isinstance(step, (Compute, Reduce)):
        tracer.add("compute", f"{op} {type(step).__name__.lower()} {step.slot}", t0, t1)
    elif isinstance(step, Wait):
        t = step.transfer
        tracer.add(f"{t.kind} {'to' if t.kind == 'send' else 'from'} {t.peer}",
                   f"{op} slot {t.slot}", posted_at.pop(t), t1)
        if t1 - t0 > 1e-5:
            tracer.add("wait", f"{op} wait {t.kind} {t.slot}", t0, t1)
    elif isinstance(step, WaitCollective):
        tracer.add("collective", f"{op} chunk {step.slot}",
                   posted_at.pop(("collective", step.slot)), t1)
        if t1 - t0 > 1e-5:
            tracer.add("wait", f"{op} wait chunk {step.slot}", t0, t1)


class Retagged:
    """A transport whose P2P tags (and collectives' tags) are moved by ``offset``: a gather
    posted ahead (`commfuse.ops.prefetch`) then never shares a (peer, tag) with the ops that
    run while it is in flight."""

    def __init__(self, transport: Transport, offset: int):
        self.inner, self.offset = transport, offset

    def post(self, transfers):
        return self.inner.post([(dataclasses.replace(t, tag=t.tag + self.offset), b)
                                for t, b in transfers])

    def launch(self, kind, out, inp, tag, **parts):
        return self.inner.launch(kind, out, inp, tag + self.offset, **parts)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Handle:
    """A posted work until it is waited: waited once (a second wait on a gloo work hung a
    run), then dropped, so its buffers are freed as soon as the schedule lets go of them."""

    def __init__(self, work):
        self.work = work


def _wait(handle: _Handle, transport: Transport, schedule: Schedule, index: int,
          transfer: Transfer | None) -> None:
    work, handle.work = handle.work, None
    if work is None:
        return
    try:
        transport.wait(work, lambda cause: _error(schedule, index, transfer, cause))
    except CommFuseError:
        raise  # a late work the CUDA watchdog reported: already named
    except Exception as e:
        raise _error(schedule, index, transfer, e) from e


def _error(schedule: Schedule, index: int, transfer: Transfer | None, cause: Exception):
    """The `CommFuseError` of a failed post or wait: op, method, rank, step (-1: draining
    what an abandoned execution left posted) and the peer: the transfer's, or for a
    collective the other rank of a pair (of more ranks, the P2P collectives name the failing
    peer in the cause's text; the backend's cannot)."""
    peer = transfer.peer if transfer else None
    if transfer:
        where = (f"{transfer.kind} of slot {transfer.slot} "
                 f"{'to' if transfer.kind == 'send' else 'from'} rank {transfer.peer}")
    elif schedule.world_size == 2:
        peer = 1 - schedule.rank
        where = f"the collective with rank {peer}"
    else:
        where = f"the collective over all {schedule.world_size} ranks"
    return CommFuseError(
        f"commfuse {schedule.op} (method={schedule.method}, rank {schedule.rank} of "
        f"{schedule.world_size}) failed at step {index} waiting for {where}: "
        f"{type(cause).__name__}: {cause}", op=schedule.op, method=schedule.method,
        rank=schedule.rank, step=index, peer=peer)

"""CUDA transport: P2P batches issued from a communication stream, ordered by events.

Imported lazily by `commfuse.runtime.modes` only when the tensors live on a GPU.

What NCCL does (ProcessGroupNCCL): every P2P batch of a group runs on that group's internal
NCCL stream, which first waits for the stream that is *current* when the batch is issued;
``work.wait()`` makes the current stream wait for the batch (the host does not block). So:

- Ordering. A batch is issued with ``comm`` current, a side stream that runs no kernels and
  waits only for what the batch sends, whichever came last: the event recorded on the
  compute stream right after the slot was produced (`produced`, called by the executor after
  each Compute/Reduce), or the receive that wrote the same memory (a ring forward); data that
  existed before the op (its inputs, the preallocated outputs receives land in) is covered by
  the event recorded when this transport was made, which ``comm`` waits for first. Issued from the compute stream, it would wait for every GEMM queued so far. The
  compute stream waits for a transfer only at its ``Wait`` step, on that batch's work alone.
- Memory. No ``record_stream`` (it ties a free to whatever the consumer stream has queued
  when the tensor dies, so memory is held by how far the CPU ran ahead; FSDP2 dropped it for
  this). Instead: (1) every receive buffer the binding allocates is allocated on the compute
  stream *before* the transport starts (`commfuse.runtime.executor.Execution` asks the binding
  for all of them first, then calls `begin`), so the event ``comm`` waits for at `begin`
  comes after every earlier use of that memory, and no batch writes into memory a queued
  GEMM still reads; (2) every posted buffer stays referenced here until its work has been
  waited, and the compute stream, on which the caller frees it, waits for the transfer there.
- Deadlines. With an explicit ``timeout`` a wait stays stream-ordered and the work goes to
  `commfuse.runtime.deadlines.WATCHDOG` with its deadline (from its post, below the group's
  timeout); a late transfer aborts the group's communicator, then ends in `CommFuseError` at
  the host's next wait or op on the group. Without one NCCL's watchdog enforces the group's
  timeout. Either way no wait here blocks the host.
- Priority. The NCCL kernels run on ProcessGroupNCCL's internal stream (high priority where
  commfuse creates the group: `comm_options`); the side stream ``comm`` runs none, and is
  created with the same priority (`comm_priority`; `COMMFUSE_HIGH_PRIORITY_COMM=0`: default).
- One NCCL stream per group: the batches of one call run one after another, in post order,
  even `direct`'s up-front ones; the simulator models that (``Hardware.serial_p2p``).

The CUDA and NCCL calls go through a `Backend`, so that a recording fake can check the
stream ordering on CPU (``tests/test_cuda_order.py``) and `commfuse.runtime.nccl_model` can
match the batches and collectives of virtual ranks in NCCL's order (``tests/test_nccl_order.py``,
check-gpu's loopback).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from commfuse.runtime import collectives, deadlines
from commfuse.runtime.transport import Transport

PRIORITY_ENV = "COMMFUSE_HIGH_PRIORITY_COMM"


def high_priority() -> bool:
    """Whether communication streams run at high priority: yes unless the environment sets
    ``COMMFUSE_HIGH_PRIORITY_COMM=0`` (then commfuse's side stream and, where commfuse creates
    the group, NCCL's own stream get the default priority)."""
    return os.environ.get(PRIORITY_ENV, "1") != "0"


def comm_priority() -> int:
    """The priority of commfuse's communication stream: -1 (a lower number runs first; torch
    maps it to the device's highest) or, switched off, the default 0."""
    return -1 if high_priority() else 0


def comm_options(backend: str):
    """``pg_options`` for a group of ``backend`` that commfuse creates: for NCCL,
    ``ProcessGroupNCCL.Options`` with ``is_high_priority_stream`` (NCCL's kernels on a
    high-priority stream, so a GEMM does not hold a transfer back) as `high_priority` says;
    None for any other backend, or where this torch has no NCCL."""
    if backend != "nccl" or not dist.is_nccl_available():
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = high_priority()
    return opts


class Backend:
    """The CUDA and NCCL calls the transport makes (a fake replaces it in tests)."""

    def __init__(self):
        self._streams: dict = {}

    def comm_stream(self, device: torch.device):
        """One communication stream per device, created on first use (`comm_priority`)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device, priority=comm_priority())
        return self._streams[device]

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def use(self, stream):
        """Context manager making ``stream`` current."""
        return torch.cuda.stream(stream)

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def issue(self, group: dist.ProcessGroup, transfers) -> Any:
        """Issue one batch of (Transfer, buffer) as NCCL P2P ops; returns its one work."""
        ops = [dist.P2POp(dist.isend if t.kind == "send" else dist.irecv, buf,
                          dist.get_global_rank(group, t.peer), group, tag=t.tag)
               for t, buf in transfers]
        works = dist.batch_isend_irecv(ops)  # NCCL (torch >= 2.1): one work for the batch
        return works[0] if len(works) == 1 else _AllOf(works)

    def launch(self, group: dist.ProcessGroup, kind: str, out, inp, tag: int, policy: str,
               **parts) -> Any:
        """Start collective ``kind`` (`commfuse.runtime.collectives.launch`)."""
        return collectives.launch(kind, out, inp, group, tag, policy, **parts)


class _AllOf:
    """Several works waited as one (a backend that returns one work per op of a batch)."""

    def __init__(self, works):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, *args) -> bool:
        return all([w.wait(*args) for w in self.works])


BACKEND = Backend()


class CudaTransport(Transport):
    """Posts one op call's batches from the comm stream; waits are stream-ordered (above)."""

    preallocates = True  # the executor allocates receive buffers before `begin`

    def __init__(self, group, device: torch.device, timeout_s: float | None,
                 collective: str = "auto", backend: Backend | None = None):
        super().__init__(group, device, timeout_s, collective)
        deadlines.WATCHDOG.raise_failed(group)  # once per op: a communicator aborted before
        # a group may carry its own backend (commfuse check-gpu's loopback ranks)
        self.cuda = backend or getattr(group, "commfuse_backend", None) or BACKEND
        self.comm = self.cuda.comm_stream(device)
        self.compute = self.cuda.current_stream(device)
        self.begin()
        # the latest producer of a slot (its GEMM or add: an event on the compute stream) and
        # of a received buffer (by address: the receive's work), as (order, kind, dep)
        self.by_slot: dict[int, tuple] = {}
        self.by_ptr: dict[int, tuple] = {}
        self.seq = 0
        # id(work) -> (work, its buffers, its post time) until waited
        self.held: dict[int, tuple[Any, list, float]] = {}

    def begin(self) -> None:
        """Every batch comes after what the compute stream queued so far: the op's inputs,
        the outputs receives land in, the receive buffers allocated for it."""
        self.cuda.wait_event(self.comm, self.cuda.record_event(self.compute))

    def produced(self, slot: int) -> None:
        self._note(self.by_slot, slot, "event", self.cuda.record_event(self.compute))

    def _note(self, table: dict, key, kind: str, dep) -> None:
        self.seq += 1
        table[key] = (self.seq, kind, dep)

    def post(self, transfers):
        deps = {}  # what the sends' data waits for: the latest producer of its slot or memory
        for t, buf in transfers:
            if t.kind == "send":
                known = [d for d in (self.by_slot.get(t.slot), self.by_ptr.get(buf.data_ptr()))
                         if d is not None]
                if known:
                    deps[max(known)[0]] = max(known)
        with self.cuda.use(self.comm):  # the batch waits for its own data only
            for _, kind, dep in deps.values():
                if kind == "event":
                    self.cuda.wait_event(self.comm, dep)
                else:
                    dep.wait()  # a forward: comm waits for the receive that brought it
            work = self.cuda.issue(self.group, transfers)
        for t, buf in transfers:
            if t.kind == "recv":
                self._note(self.by_ptr, buf.data_ptr(), "work", work)
        self.held[id(work)] = (work, [buf for _, buf in transfers], time.monotonic())
        return [work] * len(transfers)

    def launch(self, kind, out, inp, tag, **parts) -> Any:
        # the collective's NCCL stream waits for the compute stream (NCCL's own rule)
        work = self.cuda.launch(self.group, kind, out, inp, tag, self.collective, **parts)
        self.held[id(work)] = (work, [out, inp], time.monotonic())
        return work

    def wait(self, work: Any, error=None) -> None:
        """The compute stream waits for ``work`` alone (the host does not); with a
        ``timeout`` the watchdog keeps its deadline from the post (`commfuse.runtime.deadlines`)
        and ``error(cause)`` makes the `CommFuseError` of a late one."""
        _, _, since = self.held.get(id(work), (None, None, None))
        deadlines.stream_wait(work, self.group, self.device,
                              self.timeout.total_seconds() if self.deadline_set else None,
                              since, error)
        self.held.pop(id(work), None)  # its buffers may be freed now

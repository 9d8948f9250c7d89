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
- Memory. ``record_stream(comm)`` would protect nothing (no kernel uses the memory on
  ``comm``). Instead: (1) every posted buffer stays referenced here until its work has been
  waited (then the compute stream, on which the caller frees it, is ordered after the
  transfer); (2) receive buffers that the binding allocates during the op are allocated with
  ``comm`` current (`allocating`), so the allocator never hands a receive memory that a
  GEMM still queued on the compute stream reads, and they are recorded on the compute stream
  that consumes them, so freeing them waits for those kernels.
- Deadlines. With an explicit ``timeout`` the host polls ``work.is_completed()`` until the
  deadline, so a dead peer ends in `CommFuseError`; that host wait costs the CPU its run-ahead
  (the GPU keeps the overlap already queued). Without one, nothing blocks the host and NCCL's
  watchdog enforces the group's timeout.
- One NCCL stream per group: the batches of one call run one after another, in post order,
  even `direct`'s up-front ones; the simulator models that (``Hardware.serial_p2p``).

The CUDA and NCCL calls go through a `Backend`, so that a recording fake can check the
stream ordering on CPU (``tests/test_cuda_order.py``) and `commfuse.runtime.nccl_model` can
match the batches and collectives of virtual ranks in NCCL's order (``tests/test_nccl_order.py``,
check-gpu's loopback).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from commfuse.runtime import collectives
from commfuse.runtime.transport import Transport

POLL_S = 50e-6  # host poll interval while a deadline is set


class Backend:
    """The CUDA and NCCL calls the transport makes (a fake replaces it in tests)."""

    def __init__(self):
        self._streams: dict = {}

    def comm_stream(self, device: torch.device):
        """One communication stream per device, created on first use."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
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

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

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
    def __init__(self, group, device: torch.device, timeout_s: float | None,
                 collective: str = "auto", backend: Backend | None = None):
        super().__init__(group, device, timeout_s, collective)
        # a group may carry its own backend (commfuse check-gpu's loopback ranks)
        self.cuda = backend or getattr(group, "commfuse_backend", None) or BACKEND
        self.comm = self.cuda.comm_stream(device)
        self.compute = self.cuda.current_stream(device)
        # the op's inputs and the outputs receives land in exist: every batch comes after
        self.cuda.wait_event(self.comm, self.cuda.record_event(self.compute))
        # the latest producer of a slot (its GEMM or add: an event on the compute stream) and
        # of a received buffer (by address: the receive's work), as (order, kind, dep)
        self.by_slot: dict[int, tuple] = {}
        self.by_ptr: dict[int, tuple] = {}
        self.seq = 0
        self.held: dict[int, tuple[Any, list]] = {}  # id(work) -> (work, buffers) until waited

    def allocating(self):
        return self.cuda.use(self.comm)

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
                self.cuda.record_stream(buf, self.compute)  # consumed on the compute stream
        self.held[id(work)] = (work, [buf for _, buf in transfers])
        return [work] * len(transfers)

    def launch(self, kind, out, inp, tag, **parts) -> Any:
        # the collective's NCCL stream waits for the compute stream (NCCL's own rule)
        work = self.cuda.launch(self.group, kind, out, inp, tag, self.collective, **parts)
        self.held[id(work)] = (work, [out, inp])
        return work

    def wait(self, work: Any) -> None:
        if hasattr(work, "is_completed"):  # an NCCL work
            self._poll(work)
            work.wait()  # the compute stream waits for this work only
        else:  # commfuse's collective wrappers (and Done) bound their own waits
            work.wait(self.timeout) if self.deadline_set else work.wait()
        self.held.pop(id(work), None)  # its buffers may be freed now

    def _poll(self, work) -> None:
        """With a deadline, block the host until ``work`` completes or the deadline passes."""
        if self.deadline_set:
            deadline = time.monotonic() + self.timeout.total_seconds()
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the transfer did not complete within "
                                       f"{self.timeout.total_seconds():g} s (host poll)")
                time.sleep(POLL_S)

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

For measurement (``commfuse bench``) the executor has process-wide modes, set with `mode`:
``"compute_only"`` runs the same partitioned GEMMs with no transfers, ``"comm_only"`` the same
transfers with empty GEMMs, ``"record"`` runs normally and lists the collectives launched;
and an optional `Tracer` records compute and transfer spans for a timeline.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commfuse import _p2p, collectives
from commfuse.errors import CommFuseError
from commfuse.schedule import (Collective, Compute, Post, Reduce, Schedule, Transfer, Wait,
                               WaitCollective)

DEFAULT_TIMEOUT_S = 600.0  # used when the group's own timeout cannot be read
MODES = ("normal", "compute_only", "comm_only", "record")
_state: dict[str, Any] = {"mode": "normal", "tracer": None, "recorded": []}


@contextlib.contextmanager
def mode(name: str, tracer: "Tracer | None" = None):
    """Run the ops inside in measurement mode ``name`` (see the module docstring)."""
    if name not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {name!r}")
    saved = dict(_state)
    _state.update(mode=name, tracer=tracer, recorded=[])
    try:
        yield _state["recorded"]
    finally:
        _state.update(saved)


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.matmul``, or in ``comm_only`` mode an uninitialised result of the same shape."""
    if _state["mode"] == "comm_only":
        return out if out is not None else a.new_empty((*a.shape[:-1], b.shape[-1]))
    return torch.matmul(a, b, out=out)


class Tracer:
    """Spans for a Chrome/Perfetto trace: (track, name, start s, end s) on this process."""

    def __init__(self):
        self.spans: list[tuple[str, str, float, float]] = []

    def add(self, track: str, name: str, start: float, end: float) -> None:
        self.spans.append((track, name, start, end))


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


class _Done:
    def wait(self, *args) -> bool:
        return True


class Transport:
    """Posts transfers and collectives for one op call and waits on them with a deadline."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 collective: str = "auto"):
        self.group, self.device = group, device
        self.timeout = timedelta(seconds=timeout_s)
        self.collective = collective  # see commfuse.collectives

    def post(self, transfers: list[tuple[Transfer, torch.Tensor]]) -> list[Any]:
        ops = []
        for t, buf in transfers:
            fn = dist.isend if t.kind == "send" else dist.irecv
            peer = dist.get_global_rank(self.group, t.peer)
            ops.append(dist.P2POp(fn, buf, peer, self.group, tag=t.tag))
        return _p2p.post(ops, self.device)

    def launch(self, kind: str, out: torch.Tensor, inp: torch.Tensor, tag: int, **parts) -> Any:
        """Start the async collective ``kind``; ``parts``: its ``sizes``/``in_sizes`` rows per
        rank where they differ (see `commfuse.collectives.launch`)."""
        return collectives.launch(kind, out, inp, self.group, tag, self.collective, **parts)

    def wait(self, work: Any) -> None:
        work.wait(self.timeout)  # bounded: a bare wait() on gloo P2P can outlive the group timeout


class NullTransport(Transport):
    """``compute_only`` mode: every transfer and collective is done at once, moving nothing."""

    def post(self, transfers):
        return [_Done() for _ in transfers]

    def launch(self, kind, out, inp, tag, **parts):
        return _Done()


class RecordingTransport(Transport):
    """``record`` mode: runs normally and notes each collective (to replay its bytes)."""

    def launch(self, kind, out, inp, tag, **parts):
        _state["recorded"].append((kind, out.shape, inp.shape, out.dtype, tag, parts))
        return super().launch(kind, out, inp, tag, **parts)


def make_transport(group: dist.ProcessGroup, device: torch.device, timeout_s: float | None,
                   collective: str = "auto") -> Transport:
    timeout_s = group_timeout(group, device) if timeout_s is None else timeout_s
    if _state["mode"] == "compute_only":
        cls = NullTransport
    elif _state["mode"] == "record":
        cls = RecordingTransport
    elif device.type == "cuda":
        from commfuse._cuda import CudaTransport as cls  # CUDA-only code, imported lazily
    else:
        cls = Transport
    return cls(group, device, timeout_s, collective)


def run(schedule: Schedule, binding: Binding, transport: Transport) -> None:
    """Execute ``schedule`` step by step; raise `CommFuseError` if a transfer fails or stalls."""
    pending: dict[Any, Any] = {}  # transfer or ("collective", slot) -> work
    posted_at: dict[Any, float] = {}
    tracer: Tracer | None = _state["tracer"]
    op = schedule.op
    for index, step in enumerate(schedule.steps):
        t0 = time.perf_counter()
        if isinstance(step, Compute):
            binding.compute(step.slot)
        elif isinstance(step, Post):
            try:
                bufs = [(t, binding.buffer(t)) for t in step.transfers]
                # empty slices (more ranks than rows) move nothing: both sides know the sizes
                works = iter(transport.post([(t, b) for t, b in bufs if b.numel()]))
                works = [next(works) if b.numel() else _Done() for _, b in bufs]
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
        elif isinstance(step, Collective):
            try:
                pending[("collective", step.slot)] = _Handle(binding.collective(step.slot, transport))
            except Exception as e:
                raise _error(schedule, index, None, e) from e
            posted_at[("collective", step.slot)] = t0
        elif isinstance(step, WaitCollective):
            work = pending.pop(("collective", step.slot))
            _wait(work, transport, schedule, index, None)
            binding.collective_done(step.slot)
        if tracer is not None:
            _trace(tracer, op, step, t0, time.perf_counter(), posted_at)
    assert not pending, f"schedule left transfers unwaited: {list(pending)}"


def _trace(tracer: Tracer, op: str, step, t0: float, t1: float, posted_at: dict) -> None:
    """Compute spans on the compute track; a transfer spans from its post to its wait's end."""
    if isinstance(step, (Compute, Reduce)):
        tracer.add("compute", f"{op} {type(step).__name__.lower()} {step.slot}", t0, t1)
    elif isinstance(step, Wait):
        t = step.transfer
        tracer.add(f"{t.kind} {'to' if t.kind == 'send' else 'from'} {t.peer}",
                   f"{op} slot {t.slot}", posted_at.pop(t), t1)
        if t1 - t0 > 1e-5:
            tracer.add("wait", f"{op} wait {t.kind} {t.slot}", t0, t1)
    elif isinstance(step, WaitCollective):
        tracer.add("collective", f"{op} chunk {step.slot}", posted_at.pop(("collective", step.slot)), t1)
        if t1 - t0 > 1e-5:
            tracer.add("wait", f"{op} wait chunk {step.slot}", t0, t1)


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

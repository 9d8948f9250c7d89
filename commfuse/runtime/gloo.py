"""Posting point-to-point transfers so that they really run in the background.

gloo's ``isend`` is not always asynchronous: when the peer has already posted the matching
receive, the calling thread writes the whole message into the socket itself and returns only
when it is on its way (on the emulated testbed such an ``isend`` takes the transfer's whole
time, against well under a millisecond when the receive comes later). Posted from the compute thread, that blocks the GEMM it was meant to hide behind.
So on CPU every send is issued from a sender thread per peer (FIFO per peer, so a pair's
messages keep their order); receives never block and are posted directly. On CUDA (NCCL)
posting never blocks the host, and a send and a receive with the same peer must be grouped,
so the batch goes to ``batch_isend_irecv`` as it is.

gloo also runs one TCP connection per pair of ranks, and a pair sending to each other at once
shares it, which on the emulated links cut each direction's rate by up to half
(docs/benchmarks/testbed.md). `duplex(group)` adds a second communicator over the same ranks;
then a transfer from a lower to a higher rank uses the group, the other way the twin, and each
connection carries one direction.

Sender threads are daemons (a send blocked on a stalled peer never holds up process exit) and
belong to their group: both they and the group's twin are looked up by the group object
itself, held weakly, so a destroyed and re-created group, even at the same address, starts
afresh, and the threads of a group are stopped when it is garbage-collected.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import torch
import torch.distributed as dist

# group -> {peer: its sender thread}; group -> its reverse-direction communicator. Weak keys:
# an entry goes with its group (never found again by an object reusing its address).
_SENDERS: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, _Sender]]" = \
    weakref.WeakKeyDictionary()
_TWINS: "weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]" = \
    weakref.WeakKeyDictionary()
DEFAULT_TIMEOUT_S = 600.0  # a wait's deadline when the group's own timeout cannot be read


def duplex(group: dist.ProcessGroup | None = None) -> None:
    """Give ``group`` a second gloo communicator for the reverse direction (see above).

    Collective over the group's ranks only (every member calls it, in the same order as any
    other group creation); a no-op for groups of one rank and for non-gloo groups.
    """
    group = dist.group.WORLD if group is None else group
    if group.size() < 2 or group in _TWINS or dist.get_backend(group) != "gloo":
        return
    ranks = dist.get_process_group_ranks(group)
    twin = _TWINS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    weakref.finalize(group, _retire, weakref.ref(twin))


def _retire(twin_ref) -> None:
    """The twin's group was collected: stop the twin's sender threads (the twin communicator
    itself stays registered until the default group is destroyed)."""
    twin = twin_ref()
    if twin is not None:
        _close_all(_SENDERS.pop(twin, {}))


def _directed(group: dist.ProcessGroup, src: int, dst: int) -> dist.ProcessGroup:
    """The communicator that carries transfers from global rank ``src`` to ``dst``."""
    twin = _TWINS.get(group)
    return group if twin is None or src < dst else twin


class _Sender:
    """One daemon thread posting the sends to one peer in order (FIFO); `close` stops it."""

    def __init__(self, peer: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"commfuse-send-{peer}", daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits for the send
                    future.set_exception(e)
            del job, future, fn, args  # hold no reference to the group between sends


def _close_all(senders: dict[int, _Sender]) -> None:
    for sender in senders.values():
        sender.close()


def _sender(group: dist.ProcessGroup, peer: int) -> _Sender:
    senders = _SENDERS.get(group)
    if senders is None:
        senders = _SENDERS[group] = {}
        weakref.finalize(group, _close_all, senders)  # the group is gone: stop its threads
    if peer not in senders:
        senders[peer] = _Sender(peer)
    return senders[peer]


class PendingSend:
    """A send handed to a sender thread: waiting waits for the post, then for the work, both
    within one deadline (``timeout`` None: the group's own timeout, never unbounded)."""

    def __init__(self, future: Future, group: dist.ProcessGroup):
        self.future, self.group = future, group

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = (group_timeout(self.group, torch.device("cpu")) if timeout is None
                   else timeout.total_seconds())
        deadline = time.monotonic() + seconds
        try:  # the post itself blocks while the peer does not take the message
            work = self.future.result(seconds)
        except FutureTimeout:
            raise TimeoutError(f"the peer did not take the message within {seconds:g} s") from None
        return wait_work(work, deadline)


def wait_work(work, deadline: float) -> bool:
    """``work.wait`` until ``deadline`` (`time.monotonic`); raises if it fails, times out, or
    returns without completing (gloo's wait returns False when the backend aborts it: the
    buffer was never filled)."""
    if not work.wait(remaining(deadline)):
        raise RuntimeError("the backend gave up the wait before the transfer completed")
    return True


def remaining(deadline: float) -> timedelta:
    """The time left to ``deadline`` as a wait's timeout: at least 1 ms, since c10d reads a
    timeout that rounds to 0 ms as *no* timeout (then gloo waits for the group's)."""
    return timedelta(seconds=max(deadline - time.monotonic(), 1e-3))


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> float:
    """The process group's own timeout in seconds (what its collectives would use)."""
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # backends without readable options
        return DEFAULT_TIMEOUT_S


def post(ops: list[dist.P2POp], device: torch.device) -> list:
    """Start ``ops`` (isend/irecv P2POps); one waitable handle per op."""
    if device.type == "cuda":
        works = dist.batch_isend_irecv(ops)
        # one work per op on most backends; a single work for the whole batch on NCCL
        return works if len(works) == len(ops) else [works[0]] * len(ops)
    handles, me = [], dist.get_rank()
    for op in ops:
        if op.op is dist.isend:
            group = _directed(op.group, me, op.peer)
            handles.append(PendingSend(_sender(group, op.peer).submit(
                dist.isend, op.tensor, op.peer, group, op.tag), group))
        else:
            handles.append(dist.irecv(op.tensor, op.peer, _directed(op.group, op.peer, me), op.tag))
    return handles

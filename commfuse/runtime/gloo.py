"""Posting point-to-point transfers so that they really run in the background.

gloo's ``isend`` is not always asynchronous: when the peer has already posted the matching
receive, the calling thread writes the whole message into the socket itself and returns only
when it is on its way (measured on the emulated 1 Gbit/s testbed: a 4 MB ``isend`` call took
60-110 ms, the transfer's whole time, when the receive was posted first; 0.1-0.5 ms when it
was not). Posted from the compute thread, that blocks the GEMM it was meant to hide behind.
So on CPU every send is issued from a sender thread per peer (FIFO per peer, so a pair's
messages keep their order); receives never block and are posted directly. On CUDA (NCCL)
posting never blocks the host, and a send and a receive with the same peer must be grouped,
so the batch goes to ``batch_isend_irecv`` as it is.

gloo also runs one TCP connection per pair of ranks, and a pair sending to each other at once
got 0.5-0.8 Gbit/s each way on 1 Gbit/s emulated links, where one connection per direction got
0.95 (`scripts/link_probe.py`). `duplex(group)` adds a second communicator over the same ranks;
then a transfer from a lower to a higher rank uses the group, the other way the twin, and each
connection carries one direction.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import torch
import torch.distributed as dist

_SENDERS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid-stable group id, peer) -> thread
_TWINS: dict[int, dist.ProcessGroup] = {}  # id(group) -> its reverse-direction communicator


def duplex(group: dist.ProcessGroup | None = None) -> None:
    """Give ``group`` a second gloo communicator for the reverse direction (see above).

    Collective over the group's ranks only (every member calls it, in the same order as any
    other group creation); a no-op for groups of one rank and for non-gloo groups.
    """
    group = dist.group.WORLD if group is None else group
    if group.size() < 2 or id(group) in _TWINS or dist.get_backend(group) != "gloo":
        return
    ranks = dist.get_process_group_ranks(group)
    _TWINS[id(group)] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def _directed(group: dist.ProcessGroup, src: int, dst: int) -> dist.ProcessGroup:
    """The communicator that carries transfers from global rank ``src`` to ``dst``."""
    twin = _TWINS.get(id(group))
    return group if twin is None or src < dst else twin


def _sender(group: dist.ProcessGroup, peer: int) -> ThreadPoolExecutor:
    key = (id(group), peer)
    if key not in _SENDERS:
        _SENDERS[key] = ThreadPoolExecutor(1, thread_name_prefix=f"commfuse-send-{peer}")
    return _SENDERS[key]


class PendingSend:
    """A send handed to a sender thread: waiting waits for the post, then for the work."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None:
            return self.future.result().wait()
        deadline = time.monotonic() + timeout.total_seconds()
        try:  # the post itself blocks while the peer does not take the message
            work = self.future.result(timeout.total_seconds())
        except FutureTimeout:
            raise TimeoutError(f"the peer did not take the message within "
                               f"{timeout.total_seconds():g} s") from None
        return work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))


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
                dist.isend, op.tensor, op.peer, group, op.tag)))
        else:
            handles.append(dist.irecv(op.tensor, op.peer, _directed(op.group, op.peer, me), op.tag))
    return handles

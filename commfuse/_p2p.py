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
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

_SENDERS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid-stable group id, peer) -> thread


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
        secs = None if timeout is None else timeout.total_seconds()
        work = self.future.result(secs)  # raises TimeoutError if the post itself is stuck
        return work.wait(timeout) if timeout is not None else work.wait()


def post(ops: list[dist.P2POp], device: torch.device) -> list:
    """Start ``ops`` (isend/irecv P2POps); one waitable handle per op."""
    if device.type == "cuda":
        works = dist.batch_isend_irecv(ops)
        # one work per op on most backends; a single work for the whole batch on NCCL
        return works if len(works) == len(ops) else [works[0]] * len(ops)
    handles = []
    for op in ops:
        if op.op is dist.isend:
            handles.append(PendingSend(_sender(op.group, op.peer).submit(
                dist.isend, op.tensor, op.peer, op.group, op.tag)))
        else:
            handles.append(dist.irecv(op.tensor, op.peer, op.group, op.tag))
    return handles

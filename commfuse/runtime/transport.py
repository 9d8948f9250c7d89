"""Transports: how one op call posts its transfers and collectives and waits on them.

`Transport` is the CPU (gloo) one: point-to-point transfers go through
`commfuse.runtime.gloo.post` (sends from a sender thread, since gloo's ``isend`` can block its
caller), collectives through `commfuse.runtime.collectives`. The CUDA transport
(`commfuse.runtime.cuda`) runs the same calls on a communication stream; the measurement modes
(`commfuse.runtime.modes`) have transports of their own.

Every wait has a deadline (a bare ``wait()`` on a gloo P2P work can outlive the group's own
timeout), so a dead or stalled peer ends in an exception instead of a hang.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commfuse.runtime import collectives, gloo
from commfuse.schedule import Transfer

DEFAULT_TIMEOUT_S = 600.0  # used when the group's own timeout cannot be read


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> float:
    """The process group's own timeout in seconds (what its collectives would use)."""
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # backends without readable options
        return DEFAULT_TIMEOUT_S


class Done:
    """A work that is already complete (an empty transfer, or one that moves nothing)."""

    def wait(self, *args) -> bool:
        return True


class Transport:
    """Posts transfers and collectives for one op call and waits on them with a deadline."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float | None,
                 collective: str = "auto"):
        self.group, self.device = group, device
        self.deadline_set = timeout_s is not None  # else the group's own timeout
        self.timeout = timedelta(seconds=group_timeout(group, device) if timeout_s is None
                                 else timeout_s)
        self.collective = collective  # see commfuse.runtime.collectives

    def allocating(self):
        """Context in which the binding allocates the buffers of a post (CUDA: on the
        communication stream)."""
        return contextlib.nullcontext()

    def produced(self, slot: int) -> None:
        """The compute queued so far finished ``slot``'s data (CUDA: records an event)."""

    def post(self, transfers: list[tuple[Transfer, torch.Tensor]]) -> list[Any]:
        ops = []
        for t, buf in transfers:
            fn = dist.isend if t.kind == "send" else dist.irecv
            peer = dist.get_global_rank(self.group, t.peer)
            ops.append(dist.P2POp(fn, buf, peer, self.group, tag=t.tag))
        return gloo.post(ops, self.device)

    def launch(self, kind: str, out: torch.Tensor, inp: torch.Tensor, tag: int, **parts) -> Any:
        """Start the async collective ``kind``; ``parts``: its ``sizes``/``in_sizes`` rows per
        rank where they differ (see `commfuse.runtime.collectives.launch`)."""
        return collectives.launch(kind, out, inp, self.group, tag, self.collective, **parts)

    def wait(self, work: Any) -> None:
        work.wait(self.timeout)  # bounded: a bare wait() on gloo P2P can outlive the group timeout

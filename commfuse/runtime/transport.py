"""Transports: how one op call posts its transfers and collectives and waits on them.

`Transport` is the CPU (gloo) one: point-to-point transfers go through
`commfuse.runtime.gloo.post` (sends from a sender thread, since gloo's ``isend`` can block its
caller), collectives through `commfuse.runtime.collectives`. The CUDA transport
(`commfuse.runtime.cuda`) runs the same calls on a communication stream; the measurement modes
(`commfuse.runtime.modes`) have transports of their own.

Every wait has a deadline (a bare ``wait()`` on a gloo P2P work can outlive the group's own
timeout), so a dead or stalled peer ends in an exception instead of a hang; a wait that
returns without completing (gloo's, when the backend aborts it) raises too, since its buffer
was never filled. A transfer whose post fails raises `TransferFailed`, which names it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commfuse.runtime import collectives, gloo
from commfuse.runtime.gloo import DEFAULT_TIMEOUT_S, group_timeout  # noqa: F401 (re-exported)
from commfuse.schedule import Transfer


class TransferFailed(RuntimeError):
    """Posting ``transfer`` failed (the backend refused it: a closed connection, a bad peer)."""

    def __init__(self, transfer: Transfer, cause: Exception):
        super().__init__(str(cause))
        self.transfer = transfer


class Done:
    """A work that is already complete (an empty transfer, or one that moves nothing)."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
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

    def produced(self, slot: int) -> None:
        """The compute queued so far finished ``slot``'s data (CUDA: records an event)."""

    def post(self, transfers: list[tuple[Transfer, torch.Tensor]]) -> list[Any]:
        """One work per transfer, posted in order; `TransferFailed` names the one refused."""
        works = []
        for t, buf in transfers:
            fn = dist.isend if t.kind == "send" else dist.irecv
            try:
                peer = dist.get_global_rank(self.group, t.peer)
                works += gloo.post([dist.P2POp(fn, buf, peer, self.group, tag=t.tag)],
                                   self.device)
            except Exception as e:
                raise TransferFailed(t, e) from e
        return works

    def launch(self, kind: str, out: torch.Tensor, inp: torch.Tensor, tag: int, **parts) -> Any:
        """Start the async collective ``kind``; ``parts``: its ``sizes``/``in_sizes`` rows per
        rank where they differ (see `commfuse.runtime.collectives.launch`)."""
        return collectives.launch(kind, out, inp, self.group, tag, self.collective, **parts)

    def wait(self, work: Any, error=None) -> None:
        """Wait for ``work`` within the deadline; raise if it fails, times out or gives up
        (``error(cause)``: the `CommFuseError` a transport that raises later would raise)."""
        gloo.wait_work(work, time.monotonic() + self.timeout.total_seconds())

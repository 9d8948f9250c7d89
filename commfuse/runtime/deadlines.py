"""Deadlines of waits on CUDA, kept without holding the host.

On CPU (gloo) a wait blocks the host until its work completes or its deadline passes
(`commfuse.runtime.gloo.wait_work`): the host is the one doing the work's bookkeeping anyway.
On CUDA a blocking host wait would cost the CPU its run-ahead (and NCCL's ``work.wait(timeout)``
sleeps the host in 1 ms steps until the transfer ends), so `wait` there:

1. makes the current stream wait for the work (``work.wait()``: stream-ordered, the host goes
   on at once), and
2. when a deadline is set, hands the work to the process's `Watchdog`, a daemon thread that
   polls ``work.is_completed()`` (a CUDA event query, never a host sync). A work that is not
   complete by its deadline has its group's communicator aborted (`abort`: torch's
   ``ProcessGroup.abort()``, which aborts the NCCL communicator so that the kernels queued
   behind it, and any host sync waiting for them, return), and only then is the error
   recorded. The host raises it at its next wait or op on that group (`raise_failed`, checked
   once per op by `commfuse.runtime.cuda.CudaTransport`), and every later one, since the
   communicator is gone. So the abort always comes before the `CommFuseError`.

A deadline is counted from the work's post and kept below the group's own timeout
(`deadline_s`: at most `GROUP_FRACTION` of it), so this watchdog acts before NCCL's own, which
would otherwise tear the process down without naming the op. Without a deadline (``timeout``
None) nothing is watched here and NCCL's watchdog enforces the group's timeout.

Only the host sync the caller itself makes (``.item()``, ``.tolist()``: where the host needs
the data) ever blocks; the watchdog's abort is what ends such a block on a dead peer.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from commfuse.errors import CommFuseError
from commfuse.runtime import gloo

POLL_S = 0.01  # how often the watchdog queries the works it holds
GROUP_FRACTION = 0.9  # a deadline ends by this fraction of the group's own timeout


def on_streams(group, device: torch.device) -> bool:
    """Whether waits on ``group`` are stream-ordered: CUDA tensors, or a group carrying its
    own CUDA backend (`commfuse.runtime.virtual_ranks`)."""
    return device.type == "cuda" or getattr(group, "commfuse_backend", None) is not None


def deadline_s(timeout_s: float, group, device: torch.device) -> float:
    """The seconds a stream-ordered wait of ``timeout_s`` is watched for: at most
    `GROUP_FRACTION` of the group's timeout (commfuse's watchdog acts before NCCL's)."""
    return min(timeout_s, GROUP_FRACTION * gloo.group_timeout(group, device))


def abort(group) -> None:
    """Abort ``group``'s communicators (torch >= 2.4: ``ProcessGroup.abort()``; on NCCL,
    ``ncclCommAbort``: its pending kernels return, its later calls fail). A group without
    ``abort`` (a fake, a backend without it) is left as it is."""
    fn = getattr(group, "abort", None)
    if callable(fn):
        fn()


class _Entry:
    __slots__ = ("work", "group", "end", "seconds", "error")

    def __init__(self, work, group, end: float, seconds: float, error):
        self.work, self.group, self.end, self.seconds, self.error = work, group, end, seconds, error


class Watchdog:
    """Works with deadlines, polled on a daemon thread (started on the first `watch`); a late
    one aborts its group, then records the error for the host (`raise_failed`)."""

    def __init__(self, poll_s: float = POLL_S, abort_fn: Callable[[Any], None] = abort):
        self.poll_s, self.abort_fn = poll_s, abort_fn
        self.entries: list[_Entry] = []
        self.failed: dict[int, tuple[Any, CommFuseError]] = {}  # id(group) -> (group, error)
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def watch(self, work, group, seconds: float, since: float | None = None,
              error: Callable[[Exception], CommFuseError] | None = None) -> None:
        """Watch ``work`` until ``seconds`` after ``since`` (`time.monotonic`; default now);
        ``error(cause)`` makes the error the host will raise (default: a generic one)."""
        end = (time.monotonic() if since is None else since) + seconds
        with self.cond:
            self.entries.append(_Entry(work, group, end, seconds, error))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="commfuse-watchdog",
                                               daemon=True)
                self.thread.start()
            self.cond.notify()

    def raise_failed(self, group) -> None:
        """Raise the error of a late work of ``group``, if the watchdog aborted it."""
        hit = self.failed.get(id(group))
        if hit is not None and hit[0] is group:
            err = hit[1]
            raise CommFuseError(str(err), op=err.op, method=err.method, rank=err.rank,
                                step=err.step, peer=err.peer) from err.__cause__

    def pending(self) -> int:
        """Works watched and not yet complete (tests)."""
        with self.cond:
            return len(self.entries)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.entries:
                    self.cond.wait()
                entries = list(self.entries)
            late, done = [], set()
            now = time.monotonic()
            for e in entries:
                try:
                    complete = e.work.is_completed()
                except Exception:  # a failed work: NCCL's own error reaches its waiter
                    complete = True
                if complete:
                    done.add(id(e))
                elif now > e.end:
                    late.append(e)
                    done.add(id(e))
            for e in late:
                self._expire(e)
            with self.cond:
                self.entries = [e for e in self.entries if id(e) not in done]
                if self.entries:
                    self.cond.wait(self.poll_s)

    def _expire(self, e: _Entry) -> None:
        """Abort ``e``'s group, then record its error (in that order: the host can raise it
        only once the communicator is gone)."""
        cause = TimeoutError(f"the transfer did not complete within {e.seconds:g} s "
                             f"(commfuse watchdog; the group's communicator was aborted)")
        try:
            self.abort_fn(e.group)
        except Exception as abort_error:  # still raise the timeout on the host
            cause = TimeoutError(f"{cause}; aborting it failed: {abort_error}")
        err = e.error(cause) if e.error is not None else CommFuseError(
            f"commfuse: a wait on this group failed: TimeoutError: {cause}")
        err.__cause__ = cause
        if id(e.group) not in self.failed:
            self.failed[id(e.group)] = (e.group, err)


WATCHDOG = Watchdog()


def wait(work, group, device: torch.device, timeout_s: float | None,
         since: float | None = None, error=None) -> None:
    """Wait for ``work`` (a torch.distributed work, or commfuse's collective wrappers): on CPU
    the host waits until it completes, within ``timeout_s`` (None: the group's timeout), or
    raises; on CUDA `stream_wait`."""
    if on_streams(group, device):
        stream_wait(work, group, device, timeout_s, since, error)
        return
    seconds = gloo.group_timeout(group, device) if timeout_s is None else timeout_s
    gloo.wait_work(work, time.monotonic() + seconds)


def stream_wait(work, group, device: torch.device, timeout_s: float | None,
                since: float | None = None, error=None) -> None:
    """The current stream waits for ``work`` (``work.wait()``; the host does not block); with
    a ``timeout_s`` the `WATCHDOG` keeps its deadline (`deadline_s`, counted from ``since``),
    ``error(cause)`` making the error raised for a late work. A group whose communicator the
    watchdog aborted raises here first."""
    WATCHDOG.raise_failed(group)
    if timeout_s is not None:
        WATCHDOG.watch(work, group, deadline_s(timeout_s, group, device), since, error)
    work.wait()

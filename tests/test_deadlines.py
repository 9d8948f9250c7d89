"""Waits with deadlines (`commfuse.runtime.deadlines`) on CPU: the host waits with a timeout,
as gloo needs; on CUDA (here a fake device and fake works, labelled as such) the stream waits
(``work.wait()`` with no timeout: NCCL's timed wait sleeps the host in 1 ms steps) and only
the watchdog thread polls."""

import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import commfuse
from commfuse.errors import CommFuseError
from commfuse.runtime import deadlines

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


class FakeWork:
    """A torch.distributed work (fake): notes its waits' arguments and who polls it."""

    def __init__(self, completes=True):
        self.waits, self.polls, self.completes = [], [], completes

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True

    def is_completed(self):
        self.polls.append(threading.get_ident())
        return self.completes


class FakeGroup:
    """A process group (fake): size 2, an ``abort`` that notes its call."""

    def __init__(self):
        self.aborted = 0

    def size(self):
        return 2

    def rank(self):
        return 0

    def abort(self):
        self.aborted += 1


def test_cpu_waits_on_the_host_with_a_timeout():
    work = FakeWork()
    deadlines.wait(work, FakeGroup(), torch.device("cpu"), 3.0)
    (t,) = work.waits
    assert isinstance(t, timedelta) and 2.0 < t.total_seconds() <= 3.0


def test_cuda_waits_on_the_stream_without_a_timeout():
    work = FakeWork()
    deadlines.wait(work, FakeGroup(), CUDA, None)
    assert work.waits == [None] and work.polls == []  # stream-ordered, nothing watched


def test_cuda_with_a_timeout_is_watched_off_the_host():
    work, group = FakeWork(completes=False), FakeGroup()
    deadlines.wait(work, group, CUDA, 5.0)
    assert work.waits == [None]
    end = time.monotonic() + 5
    while not work.polls and time.monotonic() < end:
        time.sleep(0.005)
    assert work.polls and threading.get_ident() not in work.polls
    work.completes = True  # done before its deadline: let go, nothing aborted
    while deadlines.WATCHDOG.pending() and time.monotonic() < end:
        time.sleep(0.005)
    assert deadlines.WATCHDOG.pending() == 0 and group.aborted == 0


def test_a_late_wait_aborts_then_raises_at_the_next_wait():
    work, group = FakeWork(completes=False), FakeGroup()
    deadlines.wait(work, group, CUDA, 0.02)
    end = time.monotonic() + 5
    while not group.aborted and time.monotonic() < end:
        time.sleep(0.005)
    assert group.aborted == 1
    with pytest.raises(CommFuseError, match="did not complete within 0.02 s.*aborted"):
        deadlines.wait(FakeWork(), group, CUDA, None)


def test_every_host_timed_wait_goes_through_deadlines():
    """No ``wait(timedelta(...))`` outside gloo's own code (`commfuse.runtime.gloo`, the
    collectives' CPU waits, the CPU link probe and its transfer tax): elsewhere a timed wait on NCCL would hold the
    host."""
    root = Path(commfuse.__file__).parent
    allowed = {"runtime/gloo.py", "runtime/collectives.py", "runtime/probe.py",
               "runtime/tax.py"}
    hits = [str(p.relative_to(root)) for p in root.rglob("*.py")
            if str(p.relative_to(root)) not in allowed
            and re.search(r"\.wait\(\s*timedelta\(", p.read_text())]
    assert hits == []


@pytest.mark.parametrize("site", ["vocab", "counts", "grad_sync"])
def test_the_sites_wait_on_the_stream_on_cuda(site, monkeypatch):
    """The vocab-parallel embedding's collectives, the MoE counts' all-gather and a gradient
    bucket's all-reduce, with CUDA faked (`deadlines.on_streams` true, fake works): the work
    is waited with no timeout."""
    from commfuse.runtime import collectives

    monkeypatch.setattr(deadlines, "on_streams", lambda group, device: True)
    work, group = FakeWork(), FakeGroup()
    if site == "vocab":
        from commfuse.parallel import vocab

        monkeypatch.setattr(collectives, "launch", lambda *a, **k: work)
        vocab._collective("all_gather", torch.zeros(4, 2), torch.zeros(2, 2), group, [2, 2])
    elif site == "counts":
        from commfuse.ops.moe import counts

        monkeypatch.setattr(counts.dist, "all_gather", lambda *a, **k: work)
        counts._gather("moe", [1, 2], group, 5.0, "cpu")
    else:
        from types import SimpleNamespace

        from commfuse.parallel.grad_sync import GradSync

        sync = SimpleNamespace(timeout_s=None)
        bucket = SimpleNamespace(work=work, group=group, flat=torch.zeros(3), index=0, key="k",
                                 params=[])
        GradSync._wait(sync, bucket)
    assert work.waits == [None]

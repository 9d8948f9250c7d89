"""Fault injection: ranks whose peer is killed, stalls or loses its link during a fused op.

One `Case` is one run: ``world`` real gloo ranks, forked from this process (so a run costs its
op, not an interpreter start and a torch import per rank), meet through a `FileStore`, then run
``steps`` x ``op`` forward and backward with the op's ``timeout``. At its ``at``-th GEMM (0:
right before the op) the victim

- ``kill``: dies (SIGKILL, no goodbye);
- ``stall``: stops answering (sleeps until the run is over);
- ``linkdown``: takes its own network interface down and goes on (only in a network namespace
  of the emulated cluster, `commfuse.testbed.net`; both ends must then raise).

A rank that raised stays alive until the run is over, so its peers meet a silent peer, not a
closed connection: every survivor has to reach its own deadline. `run_case` classifies the
run by its worst survivor:

- ``raised``: every survivor raised `commfuse.CommFuseError`;
- ``hang``: a survivor neither raised nor returned within ``timeout_s + hang_s``;
- ``silent``: a survivor returned normally although its peer failed;
- ``other``: a survivor raised something else, or died without a report.

A survivor's time to error counts from the later of its op's start and the fault. A hung
survivor's report carries every thread's Python stack (SIGUSR1 to `faulthandler`), which shows
the wait that did not keep its deadline.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import subprocess
import tempfile
import time
import traceback

FAULTS = ("kill", "stall", "linkdown")
OUTCOMES = ("raised", "hang", "silent", "other")
PG_TIMEOUT_S = 120.0  # the group's own timeout: far above any op's, so the two are told apart
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (a rank, a load process: none may
    outlive a runner that was killed)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Case:
    """One faulty run: ``world`` ranks run ``op`` with ``method``; ``victim`` suffers ``fault``
    at its ``at``-th GEMM (0: before the op)."""

    fault: str
    op: str = "matmul_rs"
    method: str = "commfuse"
    opts: tuple[tuple[str, object], ...] = ()
    world: int = 3
    victim: int = 1
    at: int = 2
    timeout_s: float = 2.0
    steps: int = 2

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {self.fault!r}")
        if not 0 <= self.victim < self.world:
            raise ValueError(f"victim {self.victim} is not a rank of {self.world}")

    def label(self) -> str:
        opts = "".join(f" {k}={v}" for k, v in self.opts)
        return f"{self.op} {self.method}{opts} w{self.world} at={self.at}"


@dataclasses.dataclass
class RankReport:
    """What one rank that had to notice the fault did."""

    rank: int
    outcome: str  # "raised", "returned", "other", "hang" (no report) or "died" (no report, dead)
    elapsed_s: float | None  # from max(op start, fault) to its error or return
    message: str = ""
    where: dict | None = None  # a CommFuseError's op, method, rank, step and peer


@dataclasses.dataclass
class RunResult:
    case: Case
    reports: list[RankReport]
    outcome: str  # one of OUTCOMES
    worst_s: float | None  # the slowest survivor's time to error (None: one did not report)
    wall_s: float


def inject(fault: str, at: int = 2, fault_time=None) -> None:
    """Make this process suffer ``fault`` at its ``at``-th GEMM (`commfuse.runtime.modes.gemm`,
    so inside an op, after its first transfers were posted); ``at`` 0 strikes now. The moment
    goes to ``fault_time`` (a shared double) where given."""
    from commfuse.runtime import modes

    if at <= 0:
        _strike(fault, fault_time)
        return
    real, calls = modes.gemm, [0]

    def gemm(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            _strike(fault, fault_time)
        return real(*args, **kwargs)

    modes.gemm = gemm


def _strike(fault: str, fault_time) -> None:
    if fault_time is not None:
        fault_time.value = time.monotonic()
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "linkdown":
        subprocess.run(["ip", "link", "set", "dev", os.environ["GLOO_SOCKET_IFNAME"], "down"],
                       check=True)
    else:
        time.sleep(3600)


def run_op(op: str, method: str, opts: dict, world: int, timeout_s: float,
           steps: int = 2) -> None:
    """``steps`` x ``op`` forward and backward on small random inputs (the same shapes on
    every rank; two steps, so that communication follows any GEMM of the first)."""
    import torch

    from commfuse.ops import registry

    a = torch.randn(4 * world, 3, 8, requires_grad=True)
    for _ in range(steps):
        b = torch.randn(*registry.b_shape(op, world, 8, 6))
        out = registry.call(op, a, b, method, opts, timeout=timeout_s)
        out.sum().backward()


def _enter_netns(netns: str) -> None:
    """Move this process into the named network namespace (as ``ip netns exec`` does)."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


def _rank(rank: int, case: Case, store_path: str, conn, fault_time, port) -> None:
    """One rank (a forked child): meet, fault or run, report ``(outcome, t0, t1, message)``
    on ``conn``, then stay until the parent ends the run."""
    die_with_parent()
    stacks = open(f"{store_path}.stacks{rank}", "w")  # where SIGUSR1 dumps every thread's stack
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        import commfuse
        from commfuse.runtime.gloo import duplex

        torch.set_num_threads(1)
        if port is not None:
            _enter_netns(port.netns)
            os.environ["GLOO_SOCKET_IFNAME"] = port.ifname
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        store = dist.FileStore(store_path, case.world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=case.world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        duplex()
        store.add("ready", 1)  # every rank up before any fault (through the store, not gloo)
        while store.add("ready", 0) < case.world:
            time.sleep(0.005)
        if rank == case.victim:
            inject(case.fault, case.at, fault_time)
        t0 = time.monotonic()
        try:
            run_op(case.op, case.method, dict(case.opts), case.world, case.timeout_s, case.steps)
            report = ("returned", t0, time.monotonic(), "", None)
        except commfuse.CommFuseError as e:
            report = ("raised", t0, time.monotonic(), str(e),
                      {k: getattr(e, k, None) for k in ("op", "method", "rank", "step", "peer")})
        except Exception as e:
            report = ("other", t0, time.monotonic(), f"{type(e).__name__}: {e}", None)
    except BaseException:
        report = ("other", None, time.monotonic(), traceback.format_exc(), None)
    conn.send(report)
    conn.close()
    time.sleep(3600)  # the parent kills every rank at the end of the run


def run_case(case: Case, hang_s: float = 30.0, network=None) -> RunResult:
    """Run ``case`` on forked ranks and classify it (see the module docstring). ``network``:
    an `commfuse.testbed.net.EmulatedNetwork` that is up, for ``linkdown`` (rank r runs in
    its port r). Every rank is killed before this returns."""
    if case.fault == "linkdown" and network is None:
        raise ValueError("linkdown needs an emulated network (commfuse.testbed.net)")
    _preload()
    ctx = mp.get_context("fork")
    fault_time = ctx.Value("d", 0.0, lock=False)
    watched = set(range(case.world)) - ({case.victim} if case.fault != "linkdown" else set())
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="commfuse-fault-") as tmp:
        procs, conns = [], {}
        try:
            for r in range(case.world):
                recv, send = ctx.Pipe(duplex=False)
                port = network.ports[r] if network is not None else None
                p = ctx.Process(target=_rank, daemon=True,
                                args=(r, case, os.path.join(tmp, "store"), send, fault_time, port))
                p.start()
                send.close()
                procs.append(p)
                conns[recv] = r
            got = _gather(procs, conns, watched, start + case.timeout_s + hang_s)
            stacks = _stacks(procs, watched - set(got), os.path.join(tmp, "store"))
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join(10)
            for c in conns:
                c.close()
    reports = [_report(r, got.get(r), fault_time.value, procs[r], stacks.get(r, ""))
               for r in sorted(watched)]
    return _classify(case, reports, time.monotonic() - start)


def _preload() -> None:
    """Import, once and before any fork, what every rank needs (commfuse's ops pull in
    torch._dynamo: seconds of imports per rank on a loaded machine)."""
    import torch.distributed  # noqa: F401

    import commfuse.runtime.gloo  # noqa: F401
    from commfuse.ops import registry  # noqa: F401


def _gather(procs, conns: dict, watched: set[int], deadline: float) -> dict:
    """Reports of the ``watched`` ranks until all are in or ``deadline``; a rank that died
    without one maps to None."""
    got: dict[int, tuple | None] = {}
    while not watched <= set(got) and time.monotonic() < deadline:
        ready = mp.connection.wait(list(conns), timeout=min(0.2, deadline - time.monotonic()))
        for c in ready:
            r = conns.pop(c)
            try:
                got[r] = c.recv()
            except EOFError:
                got[r] = None  # the rank died before it reported
            c.close()
    return got


def _stacks(procs, ranks, store_path: str) -> dict[int, str]:
    """The Python stacks of the live ``ranks`` (SIGUSR1: `faulthandler`), where they hang."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5 if ranks else 0)
    out = {}
    for r in ranks:
        try:
            with open(f"{store_path}.stacks{r}") as f:
                out[r] = f.read()
        except OSError:
            pass
    return out


def _report(rank: int, got, fault_at: float, proc, stacks: str) -> RankReport:
    if got is None:
        dead = proc.exitcode is not None and proc.exitcode != -signal.SIGKILL
        return RankReport(rank, "died" if dead else "hang", None,
                          f"exit code {proc.exitcode}" if dead else f"no report; stacks:\n{stacks}")
    outcome, t0, t1, message, where = got
    since = max(t0 if t0 is not None else t1, fault_at or 0.0)
    return RankReport(rank, outcome, max(t1 - since, 0.0), message, where)


def _classify(case: Case, reports: list[RankReport], wall_s: float) -> RunResult:
    kinds = {r.outcome for r in reports}
    if "hang" in kinds:
        outcome = "hang"
    elif "returned" in kinds:
        outcome = "silent"
    elif kinds <= {"raised"}:
        outcome = "raised"
    else:
        outcome = "other"
    times = [r.elapsed_s for r in reports]
    worst = None if any(t is None for t in times) else max(times, default=0.0)
    return RunResult(case, reports, outcome, worst, wall_s)

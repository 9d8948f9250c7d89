"""The launcher's ranks as processes: started pinned and tied to the launcher's life, watched,
stopped together (SIGTERM, then SIGKILL after a grace period), signals forwarded."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0  # how long stopped ranks get between SIGTERM (or a forwarded signal) and SIGKILL
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _child_setup(core: int | None, parent: int, quota=None) -> None:
    """Runs in each rank between fork and exec: die with the launcher, sit on ``core``, join
    the straggler's CPU ``quota`` (before exec, so nothing of the rank runs outside it)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)
    if core is not None:
        os.sched_setaffinity(0, {core})
    if quota is not None:
        quota.add(os.getpid())


def _exit_code(returncode: int) -> int:
    """Popen's -N (killed by signal N) as a shell would report it: 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Starts the ranks, watches them, stops them all; forwards signals while running."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.signum: int | None = None

    def on_signal(self, signum: int, _frame) -> None:
        # A second signal means "now": skip the grace period.
        self.send(signal.SIGKILL if self.signum is not None else signum)
        self.signum = signum

    def start(self, cmds: list[list[str]], envs: list[dict], cores: list[int | None],
              quotas: dict | None = None) -> None:
        """Start rank r as ``cmds[r]``; a rank in ``quotas`` joins that `CpuQuota` first."""
        for r, (cmd, env, core) in enumerate(zip(cmds, envs, cores)):
            if self.signum is not None:  # interrupted while starting: start no more
                break
            # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it
            # once; killpg also reaches any children a rank starts.
            self.procs.append(subprocess.Popen(
                cmd, env=env, start_new_session=True,
                preexec_fn=functools.partial(_child_setup, core, os.getpid(),
                                             (quotas or {}).get(r))))

    def send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, first: int | None = signal.SIGTERM) -> None:
        """``first`` (if any) to every live rank, SIGKILL to those still alive after GRACE_S."""
        if first is not None:
            self.send(first)
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.send(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, timeout: float | None) -> int:
        """Block until the run ends; return its exit code (see `launch`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if self.signum is not None:
                self.stop(first=None)  # the signal was forwarded by on_signal
                return 128 + self.signum
            if failed:
                rank, code = failed[0]
                say(f"rank {rank} exited with code {_exit_code(code)}; stopping the others")
                self.stop()
                return _exit_code(code)
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                say(f"timeout after {timeout:g} s; stopping all ranks")
                self.stop()
                return 124
            time.sleep(0.02)


def say(msg: str) -> None:
    print(f"commfuse launch: {msg}", file=sys.stderr, flush=True)

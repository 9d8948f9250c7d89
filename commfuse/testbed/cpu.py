"""A CPU quota for one rank of the emulated cluster: a compute straggler.

The straggler's process is moved into a cgroup of its own whose CPU quota is a fraction of
one core (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), so its
GEMMs run that much slower while its link is unchanged. Needs root and a mounted cpu
controller; removed when the run ends.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PERIOD_US = 100_000
_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/cpu")


class CpuQuotaUnavailable(RuntimeError):
    """No writable cgroup cpu controller here."""


def _root() -> tuple[Path, bool]:
    """The cgroup directory to create under, and whether it is cgroup v2."""
    controllers = _V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return _V2, True
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1, False
    raise CpuQuotaUnavailable("no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us)")


def available() -> bool:
    """Whether this machine has a cgroup cpu controller to put a quota on."""
    try:
        _root()
    except CpuQuotaUnavailable:
        return False
    return True


class CpuQuota:
    """``fraction`` of one core for the processes `add`-ed; `remove` when they are gone."""

    def __init__(self, name: str, fraction: float):
        if not 0 < fraction <= 1:
            raise ValueError(f"a CPU quota must be a fraction of a core in (0, 1], got {fraction!r}")
        if os.geteuid() != 0:
            raise CpuQuotaUnavailable("a CPU quota needs root (cgroups)")
        root, v2 = _root()
        if v2:
            (root / "cgroup.subtree_control").write_text("+cpu")
        self.path = root / name
        self.path.mkdir(exist_ok=True)
        quota = max(1000, int(fraction * PERIOD_US))
        if v2:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self, wait_s: float = 5.0) -> None:
        """Delete the cgroup (it must be empty: retried while its processes exit)."""
        deadline = time.monotonic() + wait_s
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def remove_stale(prefix: str = "commfuse-") -> list[str]:
    """Delete the empty ``<prefix><pid>`` cgroups whose launcher ``pid`` is gone (a launcher
    killed before its teardown leaves one); a cgroup still holding processes is kept."""
    try:
        root, _ = _root()
    except CpuQuotaUnavailable:
        return []
    removed = []
    for path in root.glob(prefix + "*"):
        pid = path.name[len(prefix):]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        try:
            path.rmdir()
            removed.append(path.name)
        except OSError:
            pass  # processes still in it, or not ours to remove
    return removed

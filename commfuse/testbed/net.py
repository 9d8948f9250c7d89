"""The emulated network: a Linux network namespace per rank, a bridge, `tc` link shaping.

One run (``rid``: 6 hex digits, 3 from the launcher's pid and 3 random)::

    netns commfuse-<rid>-hub        netns commfuse-<rid>-r<i>   (one per rank i)
    +---------------------+         +------------------------------------------+
    | bridge cf<rid>br    |         | lo                                       |
    |   cf<rid>h<i> <=========veth=====> cf<rid>r<i>  198.18.X.(i+1)/24        |
    +---------------------+         |   egress: netem (delay) -> tbf (rate)    |
                                    +------------------------------------------+

Nothing is created in the host's root namespace: the bridge has a namespace of its own, in
which each veth pair is created, its rank end moved straight into the rank's namespace.
Addresses: one /24 per run of 198.18.0.0/15 (RFC 2544, reserved for benchmarks).
Shaping is on each rank's egress, so both directions of every pair are shaped. The hub ends
keep the veth default (``noqueue``) and the bridge does not queue: the hub is never the
bottleneck. Traffic *into* a rank is not limited, so several senders to one rank get the sum
of their links (a ring sends to one peer at a time and never sees this). A state file per run
(`STATE_DIR`/<rid>.json, written first) lets `cleanup_stale` remove the namespaces of runs
whose launcher died without tearing down.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from commfuse.testbed import gso
from commfuse.testbed.links import LinkSpec, tbf_params

STATE_DIR = "/tmp/commfuse-netns"
NETNS_PREFIX = "commfuse-"
MAX_RANKS = 253  # hosts .1 .. .253 of the run's /24


class EmulationUnavailable(RuntimeError):
    """This machine cannot emulate a network (not root, or no iproute2); use loopback instead."""


def check_available() -> None:
    """Raise `EmulationUnavailable` unless we are root and have `ip` and `tc`."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        why = "not running as root" if os.geteuid() != 0 else f"missing {', '.join(missing)}"
        raise EmulationUnavailable(
            f"network emulation needs root and iproute2 (ip, tc): {why}. Run as root, or use "
            f"plain loopback (launch(..., emulate=False) / --no-emulate), which shows nothing "
            f"about overlap because loopback is as fast as memcpy.")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line]


def _cpu_mask(cpus: list[int]) -> str:
    """The sysfs CPU mask of ``cpus``: hex, comma-separated every 32 CPUs."""
    digits = f"{sum(1 << c for c in cpus):x}"
    digits = digits.zfill(-(-len(digits) // 8) * 8)
    return ",".join(digits[i:i + 8] for i in range(0, len(digits), 8))


@dataclass
class RankPort:
    """One rank's end of the network."""

    netns: str
    """Its network namespace (the rank runs under ``ip netns exec <netns>``)."""
    ifname: str
    """Its interface inside that namespace (GLOO_SOCKET_IFNAME)."""
    address: str
    """Its IPv4 address."""
    link: LinkSpec
    """The shaping of its egress."""


@dataclass
class EmulatedNetwork:
    """The namespaces, bridge and veths of one run: `up` builds them, `down` removes them."""

    links: list[LinkSpec]
    """One link per rank."""
    cores: list[int | None] | None = None
    """The core each rank is pinned to (None: not pinned); its packets are processed there."""
    run_id: str = ""
    """6 hex digits naming the run's namespaces and interfaces; chosen when empty."""
    gso_bytes: int = gso.DEFAULT
    """The largest TCP super-packet to ask of every interface (`commfuse.testbed.gso`)."""
    delay_emulated: bool = True
    """Set by `up`: False when a delay or jitter was asked for but the kernel lacks sch_netem."""
    gso_in_force: int = gso.LEGACY_GSO
    """Set by `up`: the super-packet size the kernel took (64 KiB where it has no BIG TCP)."""
    ports: list[RankPort] = field(default_factory=list, init=False)
    """Each rank's namespace, interface, address and link."""
    _created: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= len(self.links) <= MAX_RANKS:
            raise ValueError(f"need 1..{MAX_RANKS} ranks, got {len(self.links)}")
        taken = [n for n in list_netns() if n.startswith(NETNS_PREFIX)]
        while (not self.run_id or any(self.run_id in n for n in taken)
               or os.path.exists(self.state_file)):
            self.run_id = f"{os.getpid() & 0xFFF:03x}{secrets.randbits(12):03x}"
        n = int(self.run_id, 16) % 512  # which /24 of 198.18.0.0/15
        subnet = f"198.{18 + n // 256}.{n % 256}"
        self.ports = [RankPort(f"{NETNS_PREFIX}{self.run_id}-r{i}", f"cf{self.run_id}r{i}",
                               f"{subnet}.{i + 1}", link) for i, link in enumerate(self.links)]

    @property
    def hub(self) -> str:
        """The namespace of the bridge."""
        return f"{NETNS_PREFIX}{self.run_id}-hub"

    @property
    def state_file(self) -> str:
        """Where the run records its launcher and namespaces, for `cleanup_stale`."""
        return os.path.join(STATE_DIR, f"{self.run_id}.json")

    def up(self) -> None:
        """Create everything; on any failure remove what was made and re-raise."""
        self._write_state()
        try:
            self._add_netns(self.hub)
            bridge = f"cf{self.run_id}br"
            # No STP and no forwarding delay: a port forwards as soon as its veth is up.
            _run("ip", "-n", self.hub, "link", "add", bridge, "type", "bridge",
                 "stp_state", "0", "forward_delay", "0")
            _run("ip", "-n", self.hub, "link", "set", bridge, "up")
            wants_delay = any(p.link.delay_us or p.link.jitter_us for p in self.ports)
            self.delay_emulated = not wants_delay or self._has_netem()
            self.gso_in_force = min(self._add_rank(i, port, bridge)
                                    for i, port in enumerate(self.ports))
            self._steer_rx()
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove the run's namespaces (killing whatever still runs there); idempotent."""
        for name in reversed(self._created):
            _delete_netns(name)
        self._created.clear()
        _remove(self.state_file)

    def _write_state(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {"run_id": self.run_id, "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                 "netns": [self.hub] + [p.netns for p in self.ports], "created": time.time()}
        with open(f"{self.state_file}.tmp", "w") as f:
            json.dump(state, f)
        os.replace(f"{self.state_file}.tmp", self.state_file)  # never read half-written

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _has_netem(self) -> bool:
        """Probe sch_netem on the hub's loopback (some VM kernels are built without it)."""
        tc = ("tc", "-n", self.hub, "qdisc")
        if _run(*tc, "add", "dev", "lo", "root", "netem", "delay", "1us", check=False).returncode:
            return False
        _run(*tc, "del", "dev", "lo", "root", check=False)
        return True

    def _add_rank(self, i: int, port: RankPort, bridge: str) -> int:
        """Add rank ``i``'s namespace, veth pair and shaping; the super-packet size it took."""
        self._add_netns(port.netns)
        hub_end = f"cf{self.run_id}h{i}"
        # Created inside the hub, the rank end moved into its namespace at once.
        _run("ip", "-n", self.hub, "link", "add", hub_end, "type", "veth",
             "peer", "name", port.ifname, "netns", port.netns)
        _run("ip", "-n", self.hub, "link", "set", hub_end, "master", bridge, "up")
        packet = gso.LEGACY_GSO
        if self.gso_bytes > gso.LEGACY_GSO:
            packet = min(self._set_gso(self.hub, hub_end, bridge),
                         self._set_gso(port.netns, port.ifname))
        # No IPv6 link-local address: gloo must only see the IPv4 address of this interface.
        _run("ip", "-n", port.netns, "link", "set", port.ifname, "addrgenmode", "none")
        _run("ip", "-n", port.netns, "addr", "add", f"{port.address}/24", "dev", port.ifname)
        _run("ip", "-n", port.netns, "link", "set", port.ifname, "up")
        self._shape(port, packet)
        return packet

    def _set_gso(self, netns: str, *ifnames: str) -> int:
        """Ask for `gso_bytes` on ``ifnames`` in ``netns``; the size in force (best effort: a
        kernel without BIG TCP for IPv4 keeps 64 KiB, and so does a failure here)."""
        proc = _run("ip", "netns", "exec", netns, sys.executable, "-m", "commfuse.testbed.gso",
                    str(self.gso_bytes), *ifnames, check=False)
        try:
            return int(proc.stdout.strip()) if proc.returncode == 0 else gso.LEGACY_GSO
        except ValueError:
            return gso.LEGACY_GSO

    def _shape(self, port: RankPort, packet: int) -> None:
        """Egress of ``port``: netem (delay, jitter) at the root, tbf (rate) as its child.

        The layout of the netem documentation: a packet first waits out its delay, then queues
        for the bandwidth, so the two add up like propagation plus serialisation.
        """
        link, tc = port.link, ("tc", "-n", port.netns, "qdisc", "add", "dev", port.ifname)
        burst, limit = tbf_params(link.rate_bps, packet)
        tbf = ("tbf", "rate", f"{link.rate_bps}bit", "burst", str(burst), "limit", str(limit))
        if not (self.delay_emulated and (link.delay_us or link.jitter_us)):
            _run(*tc, "root", "handle", "1:", *tbf)
            return
        # netem's queue (in packets) must hold everything in flight during the delay.
        in_flight = link.rate_bps / 8 * (link.delay_us + link.jitter_us) * 1e-6 / 1514
        jitter = [f"{link.jitter_us:g}us"] if link.jitter_us else []
        _run(*tc, "root", "handle", "1:", "netem", "delay", f"{link.delay_us:g}us", *jitter,
             "limit", str(max(1000, int(4 * in_flight))))
        _run(*tc, "parent", "1:1", "handle", "10:", *tbf)

    def _steer_rx(self) -> None:
        """Pick the CPU that processes each hop's packets (RPS); this also keeps them in order.

        Without it a veth hands each packet to the backlog of whichever CPU sent it or released
        it from tbf (whose timer fires on any CPU), two backlogs reorder a flow, and TCP
        retransmits spuriously (measured at 1gbit: 8 to 210 segments per 160 MB; with it, 0-1).
        A pinned rank's packets are processed on its own core both ways, at the hub end of its
        veth when it sends and at its own end when it receives, as a NIC's would be.
        """
        allowed = sorted(os.sched_getaffinity(0))
        scripts: dict[str, list[str]] = {self.hub: []}
        for i, port in enumerate(self.ports):
            core = self.cores[i] if self.cores else None
            mask = _cpu_mask([core] if core is not None else allowed)
            sysfs = "/sys/class/net/{}/queues/rx-0/rps_cpus"
            scripts[self.hub].append(f"echo {mask} > {sysfs.format(f'cf{self.run_id}h{i}')}")
            scripts[port.netns] = [f"echo {mask} > {sysfs.format(port.ifname)}"]
        for netns, lines in scripts.items():  # best effort: a kernel without RPS only reorders
            _run("ip", "netns", "exec", netns, "sh", "-c", "; ".join(lines), check=False)


def _pid_start(pid: int) -> str | None:
    """The start time of ``pid`` (tells a live launcher from a reused pid); None if dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _delete_netns(name: str) -> None:
    """Kill whatever still runs in namespace ``name``, then delete it (its veths go with it)."""
    for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", name, check=False)


def cleanup_stale(verbose: bool = True) -> list[str]:
    """Remove the namespaces of runs whose launcher is dead; return their run ids.

    A run's state file names its launcher (pid and start time, so a reused pid does not count
    as alive) and its namespaces; processes still running in them are killed first.
    """
    if not os.path.isdir(STATE_DIR):
        return []
    existing, cleaned = None, []
    for entry in sorted(e for e in os.listdir(STATE_DIR) if e.endswith(".json")):
        path = os.path.join(STATE_DIR, entry)
        try:
            with open(path) as f:
                state = json.load(f)
            if _pid_start(int(state["pid"])) == state["pid_start"]:
                continue  # its launcher is alive: not ours to touch
        except FileNotFoundError:
            continue  # its launcher just tore down
        except (OSError, ValueError, KeyError, TypeError):
            state = {"run_id": entry[:-5], "netns": []}  # unreadable: drop the file
        existing = list_netns() if existing is None else existing
        for name in state.get("netns", []):
            if name in existing and name.startswith(NETNS_PREFIX):
                _delete_netns(name)
        _remove(path)
        cleaned.append(str(state.get("run_id")))
    if cleaned and verbose:
        print(f"commfuse: removed stale emulated networks {', '.join(cleaned)}", file=sys.stderr)
    return cleaned

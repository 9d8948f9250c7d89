"""The emulated cluster: run N ranks of a command, each behind its own shaped network link.

Gloo over loopback moves bytes as fast as memcpy and shows nothing about overlap. `launch`
puts every rank in its own network namespace behind a veth and a bridge, its egress shaped by
`tc` (tbf: bandwidth, netem: delay and jitter; topology in `commfuse.testbed.net`), optionally
with one slower rank (a straggler). Rank r runs ``ip netns exec <its netns> argv...`` with
torchrun's variables (MASTER_ADDR = rank 0's address, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE), GLOO_SOCKET_IFNAME = its interface, COMMFUSE_EMULATED=1,
COMMFUSE_LINK (a label of the links, for results) and COMMFUSE_RUN_ID; pinned to one core
when there are enough ("How we measure" in docs/design.md), OMP_NUM_THREADS = its share of cores,
and glibc's allocator told to keep freed memory below 32 MiB (`ALLOCATOR_ENV`). Any of these
variables the caller already set is kept as it is.

Teardown always happens: at the end, when a rank fails (the others are stopped), on timeout,
on SIGINT/SIGTERM/SIGHUP (forwarded to the ranks first), at interpreter exit. If the launcher
is killed outright, its ranks die with it (PR_SET_PDEATHSIG) and the next launch removes its
namespaces (`cleanup_stale`). Without root and iproute2, `launch` raises
`EmulationUnavailable`; ``emulate=False`` runs the same ranks on 127.0.0.1.

    commfuse launch --nproc 2 --link 1gbit --delay 50us -- python -m mymod
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field, replace

from commfuse.testbed import gso
from commfuse.testbed.cpu import CpuQuota, remove_stale
from commfuse.testbed.procs import Supervisor, say
from commfuse.testbed.links import LinkSpec
from commfuse.testbed.net import (MAX_RANKS, EmulatedNetwork, EmulationUnavailable,
                                  check_available, cleanup_stale)

__all__ = ["LinkSpec", "ClusterSpec", "EmulationUnavailable", "launch", "cleanup_stale",
           "add_launch_arguments", "spec_from_args", "main_launch"]

EMULATED_MASTER_PORT = 29500  # rank 0's namespace is fresh: nothing else can hold the port
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class ClusterSpec:
    """How many ranks, on which links, pinned or not."""

    nproc: int = 2
    """Number of ranks (processes)."""
    link: LinkSpec = field(default_factory=LinkSpec)
    """Every rank's link, unless it is the straggler."""
    straggler_rank: int | None = None
    """A rank that gets `straggler_link` instead (None: no straggler)."""
    straggler_link: LinkSpec | None = None
    """The straggler's link (None: the same as every rank's)."""
    straggler_cpu: float | None = None
    """The fraction of one core the straggler may use (a cgroup CPU quota: a compute
    straggler); None: no limit. `straggler_rank` needs this and/or `straggler_link`."""
    pin: bool | None = None
    """Pin rank i to core i % ncores; None: pin when nproc <= the cores we may run on."""
    emulate: bool = True
    """Emulate the network (root + iproute2); False: plain loopback, no shaping."""
    gso_bytes: int = gso.DEFAULT
    """The TCP super-packet size asked of the emulated links, bytes (`commfuse.testbed.gso`):
    larger takes less of the ranks' CPU per byte, and lets a bigger burst through tbf."""

    def __post_init__(self) -> None:
        if not isinstance(self.gso_bytes, int) or not (
                gso.LEGACY_GSO <= self.gso_bytes <= gso.MAX_GSO):
            raise ValueError(f"gso_bytes must be {gso.LEGACY_GSO}..{gso.MAX_GSO}, "
                             f"got {self.gso_bytes!r}")
        if not isinstance(self.nproc, int) or not 1 <= self.nproc <= MAX_RANKS:
            raise ValueError(f"nproc must be an int in 1..{MAX_RANKS}, got {self.nproc!r}")
        if not isinstance(self.link, LinkSpec):
            raise ValueError(f"link must be a LinkSpec, got {self.link!r}")
        slow = self.straggler_link is not None or self.straggler_cpu is not None
        if (self.straggler_rank is None) == slow:
            raise ValueError("straggler_rank and straggler_link/straggler_cpu go together: "
                             "give a rank and how it is slow, or none")
        if self.straggler_rank is None:
            return
        if self.straggler_cpu is not None and not (
                isinstance(self.straggler_cpu, (int, float)) and 0 < self.straggler_cpu <= 1):
            raise ValueError(f"straggler_cpu must be a fraction of a core in (0, 1], "
                             f"got {self.straggler_cpu!r}")
        if self.straggler_link is not None and not isinstance(self.straggler_link, LinkSpec):
            raise ValueError(f"straggler_link must be a LinkSpec, got {self.straggler_link!r}")
        if not 0 <= self.straggler_rank < self.nproc:
            raise ValueError(f"straggler_rank {self.straggler_rank} is not one of the ranks "
                             f"0..{self.nproc - 1}")
        if not self.emulate:
            raise ValueError("a straggler needs emulate=True: loopback cannot be shaped")

    def link_for(self, rank: int) -> LinkSpec:
        """The link of ``rank``."""
        return self.straggler_link if rank == self.straggler_rank and self.straggler_link \
            else self.link

    def describe(self) -> str:
        """The COMMFUSE_LINK label, e.g. '1gbit delay 50us; rank 1: 100mbit delay 1ms'."""
        if not self.emulate:
            return "loopback"
        slow = [self.straggler_link.describe()] if self.straggler_link else []
        slow += [f"{self.straggler_cpu:g} of a core"] if self.straggler_cpu else []
        straggler = f"; rank {self.straggler_rank}: {', '.join(slow)}" if slow else ""
        return self.link.describe() + straggler


# glibc's malloc returns freed memory to the kernel when the heap's free top outgrows a
# threshold that moves with what was freed before, so whether an op's buffers of a few MiB
# page-fault on their first writes changed from one step to the next and from one workload to
# another (query-split attention's forward at S=2048: 1500 faults and 8 % of its compute per
# step, row-parallel's none). Fixed here: buffers below 32 MiB (the most glibc's own moving
# threshold reaches) come from a heap that is never trimmed, so they are reused, as the GPU's
# caching allocator reuses memory; buffers of 32 MiB and more are fresh memory each time, as
# before (the simulator's `first_touch_bytes`).
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def _cores(spec: ClusterSpec) -> list[int | None]:
    """Rank r's core: core r % n of the n we may run on, or None for all when not pinned."""
    allowed = sorted(os.sched_getaffinity(0))
    pin = spec.pin if spec.pin is not None else spec.nproc <= len(allowed)
    return [allowed[r % len(allowed)] if pin else None for r in range(spec.nproc)]


def _rank_envs(spec: ClusterSpec, net: EmulatedNetwork | None, pinned: bool) -> list[dict]:
    """Every rank's environment: torchrun's variables, the interface, the link label."""
    if net is None:
        with socket.socket() as s:  # a port chosen by the OS, free on 127.0.0.1
            s.bind(("127.0.0.1", 0))
            port, master, label, run_id = s.getsockname()[1], "127.0.0.1", "loopback", "local"
    else:
        port, master, run_id = EMULATED_MASTER_PORT, net.ports[0].address, net.run_id
        label = spec.describe() + ("" if net.delay_emulated
                                   else " (delay not emulated: kernel lacks sch_netem)")
        label += f", GSO {net.gso_in_force // 1024} KiB"
    threads = 1 if pinned else max(1, len(os.sched_getaffinity(0)) // spec.nproc)
    envs = []
    for r in range(spec.nproc):
        env = {"OMP_NUM_THREADS": str(threads), **ALLOCATOR_ENV, **os.environ}
        env.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(spec.nproc), LOCAL_WORLD_SIZE=str(spec.nproc),
                   GLOO_SOCKET_IFNAME=net.ports[r].ifname if net else "lo",
                   COMMFUSE_EMULATED=str(int(net is not None)), COMMFUSE_LINK=label,
                   COMMFUSE_RUN_ID=run_id)
        envs.append(env)
    return envs


def launch(spec: ClusterSpec, argv: list[str], timeout: float | None = None) -> int:
    """Run ``argv`` as ``spec.nproc`` ranks and return the run's exit code.

    0 when every rank exits 0; otherwise the code of the first rank seen failing (a rank
    killed by signal N counts as 128 + N), 124 on ``timeout`` seconds, 128 + N when the
    launcher got signal N. The other ranks are then stopped (SIGTERM, SIGKILL after
    GRACE_S) and the network is removed. Raises `EmulationUnavailable` when
    ``spec.emulate`` and this machine cannot emulate (not root, or no iproute2).
    """
    if not argv:
        raise ValueError("nothing to run: argv is empty")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    if spec.emulate:
        check_available()
        cleanup_stale()
    sup, net, cores, quota = Supervisor(), None, _cores(spec), None
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, sup.on_signal) for s in _FORWARDED} if in_main else {}

    def teardown() -> None:
        sup.send(signal.SIGKILL)
        if net is not None:
            net.down()
        if quota is not None:
            for p in sup.procs:
                p.wait()
            quota.remove()

    atexit.register(teardown)
    try:
        if spec.emulate:
            net = EmulatedNetwork([spec.link_for(r) for r in range(spec.nproc)], cores,
                                  gso_bytes=spec.gso_bytes)
            net.up()
            if not net.delay_emulated:
                say("this kernel has no sch_netem: bandwidth is shaped, delay/jitter are not")
            if net.gso_in_force < spec.gso_bytes:
                say(f"the links took TCP super-packets of {net.gso_in_force // 1024} KiB, not "
                    f"the {spec.gso_bytes // 1024} KiB asked (BIG TCP for IPv4 needs Linux 6.3+): "
                    f"the kernel's network stack takes more of the ranks' CPU")
        if spec.straggler_cpu is not None:
            remove_stale()
            quota = CpuQuota(f"commfuse-{os.getpid()}", spec.straggler_cpu)
        if sup.signum is None:  # a signal during setup ends the run before it starts
            netns = [p.netns for p in net.ports] if net else [None] * spec.nproc
            sup.start([(["ip", "netns", "exec", n] if n else []) + list(argv) for n in netns],
                      _rank_envs(spec, net, cores[0] is not None), cores,
                      {spec.straggler_rank: quota} if quota else None)
        return sup.wait(timeout)
    finally:
        teardown()
        atexit.unregister(teardown)
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def add_launch_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `launch` options and the trailing command to ``parser``."""
    add_cluster_options(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command every rank runs, after --: -- python -m mymod")
    return parser


def add_cluster_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the emulated-cluster options (no command) to ``parser``; `spec_from_args` reads them."""
    g = parser.add_argument_group("emulated cluster")
    g.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    g.add_argument("--link", default="1gbit", metavar="RATE", help="bandwidth of every rank's "
                   "link, in tc units: 1gbit, 200mbit, 10gbit, 125mbps (default 1gbit)")
    g.add_argument("--delay", default="50us", help="one-way latency added to every link: 50us, "
                   "1ms, 0 (default 50us; needs the kernel's sch_netem)")
    g.add_argument("--jitter", default="0us", help="random +- variation of the delay, at most "
                   "--delay (default 0us; netem may reorder packets when non-zero)")
    g.add_argument("--straggler-rank", type=int, metavar="R", help="make rank R slow: a "
                   "different link (--straggler-link / --straggler-delay) and/or less CPU "
                   "(--straggler-cpu)")
    g.add_argument("--straggler-link", metavar="RATE",
                   help="the straggler's bandwidth (default: --link)")
    g.add_argument("--straggler-delay", metavar="DELAY",
                   help="the straggler's delay (default: --delay)")
    g.add_argument("--straggler-cpu", type=float, metavar="FRACTION",
                   help="the straggler may use this fraction of one core (a cgroup CPU quota, "
                        "e.g. 0.5: its GEMMs take twice as long; needs root)")
    g.add_argument("--gso-kib", type=int, default=gso.DEFAULT // 1024, metavar="KIB",
                   help="the TCP super-packet size of the emulated links, 64..512 KiB (default "
                        f"{gso.DEFAULT // 1024}, the kernel's own; larger needs Linux 6.3+). "
                        "Every packet costs the ranks' cores CPU that a NIC would not take "
                        "(at 256 a third of 64's), but a link idle for a while lets this size "
                        "plus 32 KiB leave at once: 256 suits benchmarks of MiB-sized "
                        "messages, not small ones (docs/design.md, \"Super-packets\")")
    g.add_argument("--no-emulate", dest="emulate", action="store_false",
                   help="plain loopback (127.0.0.1), no shaping; automatic without root")
    g.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                   help="pin rank i to core i %% ncores (default: pin when nproc <= ncores)")
    g.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="kill all ranks and tear down after this long (default: no limit)")
    return parser


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The `ClusterSpec` the parsed options describe (ValueError if they are inconsistent)."""
    link = LinkSpec(rate=args.link, delay=args.delay, jitter=args.jitter)
    if not 64 <= args.gso_kib <= 512:
        raise ValueError(f"--gso-kib must be 64..512, got {args.gso_kib}")
    straggler = None
    cpu = getattr(args, "straggler_cpu", None)
    if args.straggler_rank is not None:
        if args.straggler_link is None and args.straggler_delay is None and cpu is None:
            raise ValueError("--straggler-rank needs --straggler-link, --straggler-delay "
                             "and/or --straggler-cpu")
        if args.straggler_link is not None or args.straggler_delay is not None:
            straggler = replace(link, rate=args.straggler_link or link.rate,
                                delay=args.straggler_delay or link.delay)
    elif args.straggler_link is not None or args.straggler_delay is not None or cpu is not None:
        raise ValueError("--straggler-link/--straggler-delay/--straggler-cpu need --straggler-rank")
    return ClusterSpec(nproc=args.nproc, link=link, straggler_rank=args.straggler_rank,
                       straggler_link=straggler, straggler_cpu=cpu, pin=args.pin,
                       emulate=args.emulate,
                       gso_bytes=min(gso.MAX_GSO, args.gso_kib * 1024))


def main_launch(args: argparse.Namespace) -> int:
    """The `launch` command: run the command after ``--``; return the exit code."""
    argv = list(args.command)
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        say("no command given; usage: launch [options] -- python -m mymod")
        return 2
    try:
        spec = spec_from_args(args)
        return launch(spec, argv, timeout=args.timeout)
    except ValueError as e:
        say(str(e))
        return 2
    except FileNotFoundError as e:  # loopback mode runs argv directly
        say(f"cannot run {argv[0]!r}: {e.strerror}")
        return 127
    except EmulationUnavailable as e:
        say(f"{e}\ncommfuse launch: FALLING BACK TO LOOPBACK (COMMFUSE_LINK=loopback)")
        return launch(replace(spec, emulate=False, straggler_rank=None, straggler_link=None,
                              straggler_cpu=None),
                      argv, timeout=args.timeout)


if __name__ == "__main__":  # python -m commfuse.testbed.launch [options] -- command...
    sys.exit(main_launch(add_launch_arguments(argparse.ArgumentParser(
        prog="python -m commfuse.testbed.launch", description=__doc__.split("\n\n")[0])).parse_args()))

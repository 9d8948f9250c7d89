"""What moving bytes costs the rank that computes, measured on a CPU gloo group at start
(`commfuse.runtime.probe`): how much slower a GEMM runs beside an exchange of messages
(`transfer_slowdown`: what a piece in flight takes from the compute beside it, the model's
``interference``), and the host time one post of a batch of transfers takes (`post_cost`:
what each piece costs, the model's ``host_p2p_s``). On the emulated testbed the rank's own
core runs the network stack of its link and gloo's threads, so both are the rank's time.
"""

from __future__ import annotations

import statistics
import time

from commfuse.sim.hardware import Hardware  # (torch is imported where a device is timed)

# the probe's large GEMM (`commfuse.runtime.probe.measure`), the one a transfer slows here
GEMM_SHAPE = {"cpu": (1024, 1024, 2048), "cuda": (8192, 8192, 8192)}
EXCHANGE_S = 0.25  # how long `transfer_slowdown`'s messages stream, at the model's link rate
SLOWDOWN_ROUNDS = 3  # in that many turns, each after GEMMs with the link idle
MESSAGE_BYTES = 4 * 2 ** 20
_NOT_TIMED = -1e9  # a slowdown or post cost not timed, in `probe`'s gather
POSTS, POST_BYTES = 48, 4096  # `post_cost`'s batches and each message's size


def transfer_slowdown(hw: Hardware, group=None, dtype=None) -> float | None:
    """The model's ``interference`` measured on this rank: the ``GEMM_SHAPE`` GEMM's median
    time while the rank sends 4 MiB messages to the next rank of ``group`` and receives them
    from the previous one (both directions at once, as the ops' exchanges run), over its
    median with the link idle just before, minus 1: the median of `SLOWDOWN_ROUNDS` such
    turns (a slow spell of the machine slows one turn's GEMMs alike, idle and busy). About
    `EXCHANGE_S` of messages at ``hw``'s link rate in all move on a background thread over
    the communicators the ops use (`commfuse.runtime.gloo.duplex`). Collective over a CPU
    gloo ``group`` of 2 or more ranks; None for any other group (on a GPU the copy engine
    and NIC move the bytes: the preset's figure stays) and where no GEMM ran whole beside
    the messages (a link far faster than the model's)."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from commfuse.runtime import gloo

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2 \
            or dist.get_backend(group) != "gloo":
        return None
    group = group or dist.group.WORLD
    world, rank, me = dist.get_world_size(group), dist.get_rank(group), dist.get_rank()
    to = dist.get_global_rank(group, (rank + 1) % world)
    frm = dist.get_global_rank(group, (rank - 1) % world)
    gen = torch.Generator().manual_seed(0)
    m, k, n = GEMM_SHAPE["cpu"]
    a, b = (torch.randn(*shape, generator=gen).to(dtype or torch.float32)
            for shape in ((m, k), (k, n)))
    numel = MESSAGE_BYTES // 4
    sent, got = torch.zeros(numel), torch.empty(numel)
    count = max(3, round(EXCHANGE_S * hw.link_bandwidth / MESSAGE_BYTES / SLOWDOWN_ROUNDS))
    failed = []

    def exchange() -> None:
        try:
            for _ in range(count):
                works = [dist.isend(sent, to, group=gloo._directed(group, me, to)),
                         dist.irecv(got, frm, group=gloo._directed(group, frm, me))]
                for w in works:
                    w.wait(timedelta(seconds=60))
        except Exception as e:  # re-raised below, on the caller's thread
            failed.append(e)

    ratios = []
    for _ in range(SLOWDOWN_ROUNDS):  # idle GEMMs, then GEMMs beside messages, in turns
        idle = _rounds({"gemm": lambda: a @ b}, torch.device("cpu"), 1, {"gemm": 3})["gemm"][0]
        dist.barrier(group)
        mover = threading.Thread(target=exchange, name="commfuse-probe-exchange", daemon=True)
        mover.start()
        busy = []
        while mover.is_alive():
            t0 = time.perf_counter()
            a @ b
            if mover.is_alive():  # a GEMM the messages outlived: it ran beside them throughout
                busy.append(time.perf_counter() - t0)
        mover.join()
        if failed:
            raise failed[0]
        if busy:
            ratios.append(statistics.median(busy) / idle - 1)
    return statistics.median(ratios) if ratios else None


def post_cost(group=None) -> float | None:
    """The model's ``host_p2p_s`` measured on this rank: the median time the calling thread
    spends posting one batch of the ops' transport (`commfuse.runtime.transport.Transport`:
    a send to the next rank of ``group`` and a receive from the previous, `POST_BYTES` each),
    over `POSTS` batches, each waited before the next is posted: the time each piece of a
    split op takes from the rank's timeline besides its bytes (those the slowdown beside
    transfers charges). Collective over a CPU gloo ``group`` of 2 or more ranks; None for any
    other group (a GPU's host posts ahead of the device: `Hardware.host_async`)."""
    import torch
    import torch.distributed as dist

    from commfuse.runtime.transport import Transport
    from commfuse.schedule import Transfer

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2 \
            or dist.get_backend(group) != "gloo":
        return None
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    transport = Transport(group, torch.device("cpu"), 60.0)
    sent, got = torch.zeros(POST_BYTES // 4), torch.empty(POST_BYTES // 4)
    times = []
    dist.barrier(group)
    for i in range(1 + POSTS):
        tag = 2 ** 20 + i  # apart from the ops' tags (their slots)
        batch = [(Transfer("send", 0, (rank + 1) % world, tag), sent),
                 (Transfer("recv", 0, (rank - 1) % world, tag), got)]
        t0 = time.perf_counter()
        works = transport.post(batch)
        if i:  # the first post makes the sender thread and the connections' state
            times.append(time.perf_counter() - t0)
        for w in works:
            transport.wait(w)
    return statistics.median(times)


def _rounds(fns: dict, device, rounds: int, runs: dict) -> dict[str, list[float]]:
    """Per function of ``fns``, the median seconds of its ``runs[name]`` runs (after one
    untimed) in each of ``rounds`` rounds, which run each function's runs back to
    back, the functions in an order rotated every round. In rounds, so that a slow spell of
    the machine (module doc) slows one round's kernels alike, not one kernel's runs alone;
    back to back, as a split op's pieces run: one run of each kernel in turn makes the small
    GEMM look slower against the large one than it runs inside a split op."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names, out = list(fns), {name: [] for name in fns}
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            times = []
            for j in range(1 + runs[name]):
                sync()
                t0 = time.perf_counter()
                fns[name]()
                sync()
                if j:  # the first run warms the allocator, the kernel and the cache
                    times.append(time.perf_counter() - t0)
            out[name].append(statistics.median(times))
    return out

"""What a transfer costs the GEMM beside it (`Hardware.interference`): a GEMM's time on each rank
while 4 MiB messages stream, against the same GEMM with the link idle.

    commfuse launch --nproc 2 --link 1gbit -- python scripts/transfer_tax.py

Four phases, one after another: ``idle`` (no transfer), ``send`` (rank 0 sends to rank 1),
``recv`` (rank 1 sends to rank 0), ``both`` (each sends to the other at once, what every
method's exchange does at two ranks). In each, a background thread moves 12 messages over
the directed communicators the ops use (`commfuse.runtime.gloo.duplex`) while the main thread
times a [1024, 1024] @ [1024, 1536] GEMM (one intra-op thread) until the messages are done.
Rank 0 prints, per phase, the GEMM's median, its slowdown against ``idle`` (the model's
``interference``: compute runs at 1 / (1 + interference) of its speed) and the rate the
messages moved at. On the emulated cluster the slowdown is the CPU the kernel's network
stack takes from the rank's core (softirqs, inter-processor interrupts), which a NIC would
not take (results per super-packet size in docs/benchmarks/testbed.md).
"""

import statistics
import threading
import time

import torch
import torch.distributed as dist

from commfuse.runtime import gloo

MESSAGES, MIB = 12, 4


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gloo.duplex()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("transfer_tax.py runs on 2 ranks (commfuse launch --nproc 2)")
    peer = 1 - rank
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1536)
    out = torch.empty(1024, 1536)
    send_buf, recv_buf = torch.randn(MIB * 2 ** 18), torch.empty(MIB * 2 ** 18)
    directed = lambda src, dst: gloo._directed(dist.group.WORLD, src, dst)

    def move(sends: bool, receives: bool) -> None:
        for _ in range(MESSAGES):
            works = []
            if sends:
                works.append(dist.isend(send_buf, peer, group=directed(rank, peer)))
            if receives:
                works.append(dist.irecv(recv_buf, peer, group=directed(peer, rank)))
            for w in works:
                w.wait()

    idle = None
    for phase in ("idle", "send", "recv", "both"):
        sender = {"send": 0, "recv": 1}.get(phase)  # one direction: rank 0's view
        sends, receives = phase == "both" or sender == rank, phase == "both" or sender == peer
        dist.barrier()
        mover = threading.Thread(target=move, args=(sends, receives))
        if phase != "idle":
            mover.start()
        times, t0 = [], time.perf_counter()
        while True:
            t = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - t)
            if (phase == "idle" and len(times) >= 25) or (phase != "idle" and not mover.is_alive()):
                break
        wall = time.perf_counter() - t0
        gemm = statistics.median(times)
        idle = gemm if phase == "idle" else idle
        if rank == 0:
            rate = "" if phase == "idle" else \
                f"   {MESSAGES * MIB * 2 ** 20 * 8 / wall / 1e9:.2f} Gbit/s per direction"
            print(f"{phase:>5}: GEMM {gemm * 1e3:6.2f} ms over {len(times):3d} runs, "
                  f"slowdown {gemm / idle - 1:5.2f}{rate}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

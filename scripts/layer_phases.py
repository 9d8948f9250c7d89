"""Where a layer workload's exposed time goes: waiting for transfers, or compute slowed by them.

    commfuse launch --nproc 2 --link 1gbit -- python scripts/layer_phases.py \\
        [--seq 2048] [--d-model 1024] [--workloads attn_row,attn_qsplit] [--iters 5] [--forward]

Runs each `commfuse.bench.workloads` layer (forward+backward unless ``--forward``) under method
``commfuse`` (m chosen by the cost model, on the hardware fitted at start as ``commfuse bench``
does), first with no transfers (``compute_only``), then normally, and prints per rank the
medians of: the step; the fused ops' compute spans; the time spent waiting for transfers;
the rest (kernels outside the fused ops, such as row-parallel's SDPA, and host gaps). The
step's exposed time (normal - compute alone) splits into the growth of the spans and of the
rest (the CPU the transfers take from the compute beside them) and the waits.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from commfuse.bench import workloads
from commfuse.ops.auto import use_hardware
from commfuse.runtime import gloo, modes
from commfuse.trace import Tracer


def measure(step, rank: int, backward: bool, mode: str, iters: int) -> tuple[float, ...]:
    """Medians (ms) of step, compute spans, waits over ``iters`` runs after one warm-up."""
    runs = []
    for i in range(iters + 1):
        tracer = Tracer(rank)
        dist.barrier()
        t0 = time.perf_counter()
        with modes.mode(mode, tracer):
            step("commfuse", {}, backward)
        total = time.perf_counter() - t0
        span = lambda kinds: sum(s.end - s.start for s in tracer.spans if s.kind in kinds)
        if i:
            runs.append((total, span(("compute", "reduce")), span(("wait",))))
    return tuple(1e3 * statistics.median(r[k] for r in runs) for k in range(3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--workloads", default="attn_row,attn_qsplit")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--forward", action="store_true", help="forward only (default fwd+bwd)")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gloo.duplex()
    rank, world = dist.get_rank(), dist.get_world_size()
    _, line = use_hardware("measured", torch.empty(0))
    lines = [line] if rank == 0 else []
    for name in a.workloads.split(","):
        step = workloads.build(name, world, rank, a.seq, a.d_model, torch.float32)
        alone = measure(step, rank, not a.forward, "compute_only", a.iters)
        run = measure(step, rank, not a.forward, "normal", a.iters)
        for label, (t, spans, waits) in (("compute alone", alone), ("normal", run)):
            lines.append(f"rank {rank} {name:12s} {label:13s} step {t:8.1f}  spans {spans:8.1f}"
                         f"  waits {waits:6.1f}  rest {t - spans - waits:7.1f} ms")
        lines.append(f"rank {rank} {name:12s} exposed {run[0] - alone[0]:6.1f} ms = slowed "
                     f"compute {run[0] - run[2] - alone[0]:6.1f} + waits {run[2]:6.1f}")
    for r in range(world):  # one rank's lines at a time
        dist.barrier()
        if r == rank:
            print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Where should a GEMM->RS's backward post the next AG->GEMM's re-gather? Measure it.

    commfuse launch --nproc 2 --link 1gbit -- python scripts/prefetch_point.py [--method commfuse]

The small preset under tp=2 (the training benchmark's shapes: batch 4 x 512 tokens, float32),
forward + backward + gradient sync of one step, timed for the backward prefetch off, posted
right after the producer's last post ("posts", the default) and posted when the producer's
backward ends ("end"); the variants interleaved, medians of --iters. Rank 0 prints the table.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from commfuse.data import batches, load_corpus_tokens
from commfuse.models.llama import Llama, LlamaConfig
from commfuse.ops.prefetch import Prefetcher
from commfuse.parallel.config import ParallelDims
from commfuse.parallel.plan import parallelize
from commfuse.runtime.gloo import duplex

VARIANTS = (("off", None), ("posts", "posts"), ("end", "end"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="commfuse")
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=6)
    args = p.parse_args()
    dist.init_process_group("gloo")
    duplex()
    torch.manual_seed(0)
    cfg = LlamaConfig.preset(args.preset, max_seq_len=args.seq_len)
    mesh = ParallelDims(tp=dist.get_world_size(), method=args.method).build_mesh()
    pmodel = parallelize(Llama(cfg), mesh)
    tokens, targets = next(batches(load_corpus_tokens(), args.batch_size, args.seq_len, 0))
    times: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
    for i in range(args.iters + 1):  # the first round warms up
        for name, at in VARIANTS:
            pmodel.prefetch = None if at is None else Prefetcher(1, at)
            for layer in pmodel.model.layers:
                layer.attn.prefetch = layer.mlp.prefetch = pmodel.prefetch
            dist.barrier()
            t0 = time.perf_counter()
            pmodel.loss(tokens, targets).backward()
            pmodel.sync_grads()
            if i:
                times[name].append(time.perf_counter() - t0)
            pmodel.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        off = statistics.median(times["off"])
        print(f"{args.preset} tp={dist.get_world_size()} {args.method} "
              f"{args.batch_size}x{args.seq_len}: fwd+bwd+sync medians of {args.iters}")
        for name, _ in VARIANTS:
            med = statistics.median(times[name])
            print(f"  prefetch {name:>5}: {1e3 * med:8.1f} ms  ({med / off:.3f} of off)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

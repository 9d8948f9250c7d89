"""Generate text tensor-parallel with the fused ops, in Python (`commfuse.infer`).

    python examples/generate.py                         # spawns 2 local ranks (gloo)
    torchrun --nproc-per-node 2 examples/generate.py    # or under torchrun
    python examples/generate.py ck                      # a `commfuse train --checkpoint-dir ck`

Without a checkpoint the model is the ``tiny`` preset with random weights (seeded alike on
every rank), so the text is noise; ``commfuse train --checkpoint-dir ck --link
loopback`` trains one that writes Shakespeare-like words. ``InferenceLlama`` cuts the model
over the 2 ranks (each its heads' q/k/v rows and out-projection columns, its FFN shard);
``generate`` prefills the prompt sequence-parallel with the fused all-gather -> GEMM and
GEMM -> reduce-scatter, then decodes one token per step with a KV cache. Rank 0 prints the
text, then checks that the greedy tokens equal those of the same model in one process.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from commfuse.data import load_tokenizer
from commfuse.infer import InferenceLlama, Sampling, generate, load_llama
from commfuse.models.llama import Llama, LlamaConfig
from commfuse.testbed.spawn import run_local

PROMPT, NEW_TOKENS = "ROMEO:", 24


def main(rank: int, world: int, checkpoint: str | None = None) -> list[int]:
    if checkpoint:
        model, _ = load_llama(checkpoint)  # read back whole, whatever layout trained it
    else:
        torch.manual_seed(0)  # the same random weights on every rank
        model = Llama(LlamaConfig.preset("tiny"))
    tok = load_tokenizer()
    prompt = tok.encode(PROMPT).ids
    greedy = Sampling()  # or Sampling(temperature=0.8, top_k=40, seed=0): the same on every rank
    tp = InferenceLlama(model, dist.group.WORLD, method="auto")  # the cost model picks per op
    (tokens,) = generate(tp, [prompt], NEW_TOKENS, greedy)
    if rank == 0:
        print(tok.decode(prompt + tokens))
        (alone,) = generate(InferenceLlama(model), [prompt], NEW_TOKENS, greedy)  # one process
        assert tokens == alone, f"tp={world} tokens {tokens} differ from one process's {alone}"
        print(f"the same {NEW_TOKENS} tokens as one process")
    return tokens


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else None
    if "RANK" in os.environ:  # under torchrun: the process group comes from its environment
        dist.init_process_group("gloo")
        main(dist.get_rank(), dist.get_world_size(), path)
        dist.destroy_process_group()
    else:
        run_local(main, 2, path, timeout=120)

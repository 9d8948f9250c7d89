"""Train a transformers Llama with commfuse tensor + sequence parallelism.

    python examples/tp_transformers.py                         # spawns 2 local ranks (gloo)
    torchrun --nproc-per-node 2 examples/tp_transformers.py    # or under torchrun

Needs ``transformers`` (``pip install -e '.[hf]'``). A tiny ``LlamaForCausalLM``
(random weights, the shipped tokenizer's 4096 tokens) is sharded in place by
``commfuse.tp.parallelize(model, mesh)``: q|k|v and gate|up each read ONE fused all-gather
-> GEMM, o_proj and down_proj a fused GEMM -> reduce-scatter, the head's logits are
gathered whole on every rank. It then trains a few AdamW steps on the shipped Shakespeare
corpus (`commfuse.data`), every rank on the same batch; rank 0 trains the same model unsharded
in one process on the same batches and checks that the losses agree (float32: equal up to the
order of the sums).
"""

from __future__ import annotations

import copy
import itertools
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import commfuse.tp
from commfuse.data import VOCAB_SIZE, batches, load_corpus_tokens
from commfuse.testbed.spawn import run_local

STEPS, BATCH, SEQ = 8, 4, 64


def train(model, data) -> list[float]:
    """The loss of each AdamW step on ``data``'s (inputs, targets) batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for inputs, targets in data:
        logits = model(inputs).logits  # [BATCH, SEQ, vocab], whole on every rank
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()                # replicated parameters' gradients summed over TP here
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(rank: int, world: int) -> list[float]:
    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=344,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)  # a tied head is not supported (vocab-sharded)
    torch.manual_seed(0)  # the same initial weights on every rank
    reference = LlamaForCausalLM(cfg)
    model = commfuse.tp.parallelize(copy.deepcopy(reference), init_device_mesh("cpu", (world,)),
                                    method="commfuse")  # or "auto": the cost model picks
    # the same batches on every rank
    data = list(itertools.islice(batches(load_corpus_tokens(), BATCH, SEQ, seed=0), STEPS))
    losses = train(model, data)
    if rank == 0:
        want = train(reference, data)  # one process, unsharded
        for step, (a, b) in enumerate(zip(losses, want)):
            print(f"step {step}  loss {a:.4f}  (one process: {b:.4f})", flush=True)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        assert worst < 1e-5, f"TP losses differ from one process's by {worst:.1e}"
        print(f"losses equal one process's (max relative difference {worst:.1e})")
    return losses


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: the process group comes from its environment
        dist.init_process_group("gloo")
        main(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
    else:
        run_local(main, 2, timeout=120)

"""Tensor + sequence parallelism for a model of your own, with commfuse's parallel styles.

    python examples/tp_own_module.py                         # spawns 2 local ranks (gloo)
    torchrun --nproc-per-node 2 examples/tp_own_module.py    # or under torchrun

A small language model (embedding, one block with an RMSNorm and a SwiGLU MLP, a final norm,
a head) is sharded with torch's own ``parallelize_module`` and the styles of `commfuse.tp`:
every all-gather before a column-parallel GEMM and every reduce-scatter after a row-parallel
one is a fused commfuse op, forward and backward. It trains a few AdamW steps, then rank 0
trains the same model unsharded in one process on the same batches and checks that the
losses agree (float32: equal up to the order of the sums).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from commfuse.testbed.spawn import run_local
from commfuse.tp import (FusedColwiseParallel, FusedProjections, FusedRowwiseParallel,
                         ReplicateParallel, SeqSplit, SequenceParallelNorm, ShardSequence)

VOCAB, STEPS = 100, 6


class MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(d), MLP(d, f)

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class Model(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 64, f: int = 128):
        super().__init__()
        self.emb, self.block = nn.Embedding(vocab, d), Block(d, f)
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.block(self.emb(ids))))


def shard(model: Model, mesh, method: str = "commfuse") -> Model:
    """``model`` sharded over the 1-D ``mesh``, in place (every rank passes the same model)."""
    split = SeqSplit()  # how the current sequence is split, shared by the styles below
    kw = dict(method=method, split=split)
    return parallelize_module(model, mesh, {
        "emb": ReplicateParallel(),             # the full sequence on every rank ...
        "block": ShardSequence(split),          # ... sliced to this rank's shard from here on
        "block.norm": SequenceParallelNorm(), "norm": SequenceParallelNorm(),
        "block.mlp": FusedProjections(["gate", "up"], **kw),   # ONE all-gather for gate|up
        "block.mlp.gate": FusedColwiseParallel(**kw), "block.mlp.up": FusedColwiseParallel(**kw),
        "block.mlp.down": FusedRowwiseParallel(**kw),          # GEMM fused with reduce-scatter
        "head": FusedColwiseParallel(gather_output=True, **kw),  # whole logits on every rank
    })


def train(model: nn.Module, batches: torch.Tensor) -> list[float]:
    """The loss of each AdamW step, predicting the next token of each batch [steps, B, S]."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in batches:
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(rank: int, world: int) -> list[float]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = Model()
    model = shard(copy.deepcopy(reference), mesh)
    # two batches in turn, the same tokens on every rank; 12 positions a sequence, split 6 + 6
    # (any length works: 13 would split 7 + 6)
    two = torch.randint(VOCAB, (2, 4, 13), generator=torch.Generator().manual_seed(1))
    batches = two[torch.arange(STEPS) % 2]
    losses = train(model, batches)
    if rank == 0:
        want = train(reference, batches)  # one process, unsharded
        print("step  tp loss   1-process loss")
        for step, (a, b) in enumerate(zip(losses, want)):
            print(f"{step:4d}  {a:.6f}  {b:.6f}")
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

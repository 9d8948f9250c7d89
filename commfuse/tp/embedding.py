"""Tied input/output embeddings under TPSP: `VocabParallelEmbedding` (Megatron's
vocabulary-parallel embedding with sequence parallelism).

The output head is column-parallel over the vocabulary (rank r holds rows
``[start_r, start_r + V_r)`` of the ``[V, D]`` weight, `commfuse.tp.style.FusedColwiseParallel`),
and a tied embedding shares that parameter, so it holds the same rows. Each rank looks up
the ids that fall in its rows (the others give zeros): its output is a *partial* embedding
of the whole sequence, and the sum over the ranks is the unsharded one. The sum is taken by
the first layer's `ShardSequence` as a reduce-scatter onto the sequence shards
(`commfuse.tp.functional.scatter_sum`), so the model's own code between the embedding and
the first layer (building masks and positions from the full-length tensor, an embedding
scale) runs unchanged. That code must be per token with f(0) = 0 (a scale, dropout, a norm
without bias): each token's row is whole on its owner's rank and zero elsewhere, so the sum
of f over the ranks is f of the sum; the first layer checks that the rows this rank does not
own are still zero and refuses the model otherwise. The tied weight's gradient is the sum
of the head's and the embedding's (one parameter, two uses).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from commfuse.tp.functional import all_sum, chunk_sizes, scatter_sum
from commfuse.tp.sequence import _mesh_group, _param


class Partial:
    """The partial embedding of the current forward (written by `VocabParallelEmbedding`,
    taken by `ShardSequence`), and the mask of the tokens this rank owns."""

    def __init__(self):
        self.out: torch.Tensor | None = None
        self.owned: torch.Tensor | None = None

    def shard(self, x: torch.Tensor, dim: int, sizes, group, where: str) -> torch.Tensor | None:
        """This rank's sequence shard of the sum of every rank's ``x`` when ``x`` is (derived
        per token from) the partial embedding (``sizes`` None: the whole sum, all-reduced);
        None when no partial embedding is pending."""
        if self.out is None:
            return None
        owned, self.out, self.owned = self.owned, None, None
        if x.shape[:owned.dim()] != owned.shape or x[~owned].count_nonzero():
            raise ValueError(
                f"{where}: the tied embedding's partial output (the ids of this rank's "
                f"vocabulary rows; zeros elsewhere) reached this layer changed by more than a "
                f"per-token op f with f(0) = 0 (an added position embedding, a norm with a "
                f"bias?): commfuse.tp cannot tie this model's embeddings; untie them")
        return all_sum(x, group) if sizes is None else scatter_sum(x, dim, sizes, group)


class VocabParallelEmbedding(ParallelStyle):
    """An ``nn.Embedding`` (or subclass: Gemma's scaled embedding) whose weight is
    ``Shard(0)`` over the vocabulary: the module's own forward runs on this rank's rows with
    the ids shifted into them, and the rows of ids outside are zeroed. Its output (full
    sequence, partial over the vocabulary) is recorded in ``partial`` for the first layer's
    `ShardSequence`. `tie` then makes the head's parameter the embedding's."""

    def __init__(self, partial: Partial):
        self.partial = partial

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding applies to nn.Embedding, got "
                            f"{type(module).__name__}")
        group = _mesh_group(device_mesh)
        w = module.weight
        module.register_parameter("weight", _param(w, device_mesh, Shard(0), w.requires_grad))
        sizes = chunk_sizes(w.shape[0], group.size())
        start, rows = sum(sizes[:group.rank()]), sizes[group.rank()]
        forward, pad, partial = module.forward, module.padding_idx, self.partial

        def vocab_forward(ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            owned = (ids >= start) & (ids < start + rows)
            params, saved = module._parameters, module._parameters["weight"]
            params["weight"] = saved.to_local()
            module.padding_idx = pad - start if pad is not None and 0 <= pad - start < rows \
                else None
            try:
                out = forward(torch.where(owned, ids - start, 0), *args, **kwargs)
            finally:
                params["weight"], module.padding_idx = saved, pad
            out = out * owned.unsqueeze(-1).to(out.dtype)
            partial.out, partial.owned = out, owned
            return out

        module.forward = vocab_forward
        return module

    def __repr__(self) -> str:
        return "VocabParallelEmbedding()"


def tie(embedding: nn.Module, head: nn.Module) -> None:
    """Make ``embedding`` use ``head``'s (vocabulary-sharded) weight: one parameter."""
    if embedding.weight.shape != head.weight.shape:
        raise ValueError(f"tied embedding {tuple(embedding.weight.shape)} and head "
                         f"{tuple(head.weight.shape)} differ")
    embedding.weight = head.weight

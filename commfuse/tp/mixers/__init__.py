"""The token mixers `commfuse.tp.parallelize` plans as a whole, each a `ParallelStyle` that
runs the model module's own code on this rank's heads: Mamba-2 mixers (`mamba`), Gated
DeltaNet linear attention (`deltanet`) and multi-head latent attention (`mla`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, Shard

from commfuse.tp.attention import AssembledRows
from commfuse.tp.sequence import _param


def assemble(module: nn.Module, rows: dict[str, torch.Tensor], mesh: DeviceMesh) -> None:
    """Each submodule ``name`` of ``module`` in ``rows``: its weight and bias become
    ``Shard(0)`` DTensors of ``W[rows[name]]`` (every rank's rows in rank order), recorded as
    its `AssembledRows` (``_commfuse_rows``, which `commfuse.tp.attention.unpack_rows` maps
    back to the model's layout)."""
    for sub, idx in rows.items():
        m = getattr(module, sub)
        for name in ("weight", "bias"):
            p = getattr(m, name)
            if p is not None:
                m.register_parameter(name, _param(p.detach()[idx], mesh, Shard(0),
                                                  p.requires_grad))
        m._commfuse_rows = AssembledRows(idx)

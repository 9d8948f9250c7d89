"""`SplitDimNorm`: an RMSNorm over a dimension that TP splits (OLMo 2's and OLMo 3's q_norm /
k_norm over the whole projection width, ``H * head_dim``).

Rank r holds the columns of its projection's shard, so it holds those columns of the norm's
weight (``Shard(0)``, laid out as the projection: block-repeated where kv heads are
replicated) and computes its part of the sum of squares; one all-reduce of ``[.., 1]`` floats
per call gives every rank the whole row's (`commfuse.tp.functional.all_sum`, whose backward
sums the gradients the same way). With replicated blocks each copy enters the sum once per
rank that holds it, and the divisor counts the copies, so the mean is the model's.
`rms_norm_like` checks that a module computes ``weight * x / rms(x)`` before the plan
replaces its forward.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from commfuse.tp.functional import all_sum, sum_grad
from commfuse.tp.sequence import _mesh_group, _param

EPS = ("variance_epsilon", "eps")


def _eps(module: nn.Module) -> float | None:
    for name in EPS:
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, ss: torch.Tensor, n: int, eps: float):
    y = x.float() * torch.rsqrt(ss / n + eps)
    return (weight * y).to(x.dtype)


def rms_norm_like(module: nn.Module) -> bool:
    """Whether ``module`` computes ``weight * x * rsqrt(mean(x^2) + eps)`` over its last dim
    (checked on a random input; Gemma's ``1 + weight`` or a LayerNorm's centring fail; a
    gated norm, whose forward takes a second input, is not one)."""
    w, eps = getattr(module, "weight", None), _eps(module)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None or \
            sorted(n for n, _ in module.named_parameters()) != ["weight"] or \
            len(inspect.signature(module.forward).parameters) != 1:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g) + 0.5
    with torch.no_grad():
        want = _rms(x, w.detach().float(), x.pow(2).sum(-1, keepdim=True), w.shape[0], eps)
        return torch.allclose(module(x.to(w.dtype)).float(), want.float(), rtol=1e-3, atol=1e-5)


class SplitDimNorm(ParallelStyle):
    """An RMSNorm whose normalised dim is column-sharded like the projection before it:
    ``replicas`` as that projection's `FusedColwiseParallel` (`unpack_rows` reads both)."""

    rows = None

    def __init__(self, replicas: int = 1):
        self.replicas = replicas

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = _mesh_group(device_mesh)
        T, k, w = device_mesh.size(), self.replicas, module.weight
        t = w.detach()
        if k > 1:  # blocks b0 b1 .. -> b0 b0 b1 b1 .. (k copies each), as the projection's
            t = t.reshape(T // k, -1).repeat_interleave(k, 0).flatten()
        module.register_parameter("weight", _param(t, device_mesh, Shard(0), w.requires_grad))
        eps, slot, slots = _eps(module), group.rank() // k, T // k

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight.to_local()
            if k > 1:
                weight = sum_grad(weight, group, slot, slots)
            ss = all_sum(x.float().pow(2).sum(-1, keepdim=True), group)
            return _rms(x, weight, ss, T * x.shape[-1], eps)

        module.forward = forward
        module._commfuse_split_norm = self
        return module

    def __repr__(self) -> str:
        return f"SplitDimNorm(replicas={self.replicas})"

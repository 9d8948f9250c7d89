"""Expert load: the tokens each sparse MoE layer routes to each expert, counted over every
rank, and DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free
Load Balancing Strategy for Mixture-of-Experts"): after each step, every router's
score-correction bias moves by ``rate`` toward the experts that got fewer tokens than the
mean, ``b_e += rate * sign(mean_load - load_e)``, from the load summed over the whole
data-parallel x expert-parallel x tensor-parallel world, not through the gradient.

Works on a model parallelized by `commfuse.tp.parallelize` (each rank counts its own tokens:
its sequence shard of its batch) and on the unsharded model alike: the counts are taken
where the block hands its routed tokens to its experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from commfuse.tp.experts import expert_spec

BIAS = "e_score_correction_bias"  # the router buffer DeepSeek-V3's balancing updates


class ExpertLoad:
    """Counts the rows each sparse block of ``model`` routes to each expert, from a forward
    pre-hook on its ``experts`` (``experts(x, top_k_index, top_k_weights)``); `take` returns
    them summed over ``group`` and starts over. ``routers``: each block's router, in the
    layers' order."""

    def __init__(self, model: nn.Module):
        self.blocks = [m for m in model.modules() if _routed(m)]
        self.routers = [getattr(b, expert_spec(b).router) for b in self.blocks]
        self.experts = [expert_spec(b).experts for b in self.blocks]
        self._counts = [torch.zeros(E, dtype=torch.long) for E in self.experts]
        for i, block in enumerate(self.blocks):
            block.experts.register_forward_pre_hook(self._hook(i), with_kwargs=True)

    def _hook(self, i: int):
        def count(_, args, kwargs):
            index = args[1] if len(args) > 1 else next(
                v for k, v in kwargs.items() if "index" in k or "indices" in k)
            if torch.is_grad_enabled():  # training forwards only, not generation
                self._counts[i] += torch.bincount(index.reshape(-1).cpu(),
                                                  minlength=self.experts[i])
        return count

    def take(self, group=None) -> list[torch.Tensor]:
        """Each block's per-expert counts since the last call, summed over ``group`` (None:
        the default group when one is initialized; every rank must call)."""
        counts = torch.stack(self._counts) if self._counts else torch.zeros(0, dtype=torch.long)
        if len(self._counts) and dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        for c in self._counts:
            c.zero_()
        return list(counts)

    def update_bias(self, counts: list[torch.Tensor], rate: float) -> int:
        """``b_e += rate * sign(mean - load_e)`` on each router with a score-correction bias;
        returns how many it updated."""
        n = 0
        for router, load in zip(self.routers, counts):
            bias = getattr(router, BIAS, None)
            if bias is None:
                continue
            load = load.to(bias.dtype)
            with torch.no_grad():
                bias += rate * torch.sign(load.mean() - load).to(bias.device)
            n += 1
        return n


def imbalance(counts: list[torch.Tensor]) -> list[dict]:
    """Per layer: the fewest and most rows an expert got and max / mean."""
    out = []
    for c in counts:
        mean = c.double().mean().item()
        out.append({"min": int(c.min()), "max": int(c.max()),
                    "imbalance": c.max().item() / mean if mean else 0.0})
    return out


def _routed(block: nn.Module) -> bool:
    spec = expert_spec(block)
    return spec is not None and spec.routed

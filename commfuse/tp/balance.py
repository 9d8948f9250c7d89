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
        specs = [(m, s) for m in model.modules() if (s := expert_spec(m)) is not None and s.routed]
        self.blocks = [m for m, _ in specs]
        self.routers = [getattr(m, s.router) for m, s in specs]
        self.experts = [s.experts for _, s in specs]
        self._counts = [torch.zeros(E, dtype=torch.long) for E in self.experts]
        for i, block in enumerate(self.blocks):
            block.experts.register_forward_pre_hook(self._hook(i), with_kwargs=True)

    def _hook(self, i: int):
        def count(_, args, kwargs):
            index = args[1] if len(args) > 1 else next(
                v for k, v in kwargs.items() if "index" in k or "indices" in k)
            if torch.is_grad_enabled():  # training forwards only, not generation
                # on the routing's device: no host sync in the forward, `take` reads them
                c = torch.bincount(index.reshape(-1), minlength=self.experts[i])
                self._counts[i] = self._counts[i].to(c.device) + c
        return count

    def take(self, group=None) -> list[torch.Tensor]:
        """Each block's per-expert counts since the last call, summed over ``group`` (None:
        the default group when one is initialized; every rank must call)."""
        if not self._counts:
            return []
        counts = torch.stack([c.to(self._counts[0].device) for c in self._counts])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        for c in self._counts:
            c.zero_()
        return list(counts.cpu())

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


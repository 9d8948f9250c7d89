"""Expert load: the tokens each sparse MoE layer routes to each expert, counted over every
rank, and DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free
Load Balancing Strategy for Mixture-of-Experts"): after each step, every router's
score-correction bias moves by ``rate`` toward the experts that got fewer tokens than the
mean, ``b_e += rate * sign(mean_load - load_e)``, from the load summed over the whole
data-parallel x expert-parallel x tensor-parallel world, not through the gradient.

Works on a model parallelized by `commfuse.tp.parallelize` (each rank counts its own tokens:
its sequence shard of its batch) and on the unsharded model alike: the counts are taken
where the block hands its routed tokens to its experts.

With an expert capacity (`commfuse.moe.capacity`): `limit_capacity` applies it to an unsharded
model as `commfuse.tp.parallelize` does over its ranks, `take_dropped` reads the fraction of
rows dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from commfuse.moe.capacity import check_factor, count_dropped, within_capacity
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


def limit_capacity(model: nn.Module, factor: float, ranks: int = 1) -> int:
    """The expert capacity of `commfuse.moe.capacity` on an unsharded ``model``, as
    ``parallelize(..., capacity_factor=factor)`` over ``ranks`` TP ranks applies it: each
    block's ``[B, S]`` tokens cut into the ranks' sequence chunks (`commfuse.even_sizes` of
    S, as `commfuse.ops.binding.split` places them), the rule applied to each chunk's ``B x S_r`` tokens, a dropped row's weight set to
    zero (so it adds nothing, and gets no gradient). Returns the blocks it covers."""
    from commfuse.ops.binding import split

    factor = check_factor(factor)
    n = 0
    for block in model.modules():
        spec = expert_spec(block)
        if spec is None or not spec.routed:
            continue
        shape = {}

        def remember(_, args, kwargs, shape=shape):
            x = args[0] if args else kwargs.get("hidden_states")
            shape["BS"] = tuple(x.shape[:-1]) if x is not None and x.dim() == 3 else None

        def limit(experts, args, kwargs, shape=shape, E=spec.experts):
            index, weights = args[1], args[2]
            B, S = shape.get("BS") or (1, index.shape[0])
            keep = torch.empty_like(index, dtype=torch.bool).view(B, S, -1)
            for at, s in split(S, ranks):
                rows = slice(at, at + s)
                keep[:, rows] = within_capacity(index.view(B, S, -1)[:, rows].reshape(B * s, -1),
                                                weights.view(B, S, -1)[:, rows].reshape(B * s, -1),
                                                E, factor).view(B, s, -1)
            keep = keep.view_as(index)
            count_dropped(experts, keep)
            return (args[0], index, weights * keep, *args[3:]), kwargs

        block.register_forward_pre_hook(remember, with_kwargs=True)
        block.experts.register_forward_pre_hook(limit, with_kwargs=True)
        n += 1
    return n


def take_dropped(model: nn.Module, group=None) -> float | None:
    """The fraction of (token, expert) rows the expert capacity dropped in the training
    forwards since the last call, over every sparse block and every rank of ``group`` (None:
    the default group when one is initialized; every rank must call); None when no block
    has a capacity."""
    counted = [m._commfuse_dropped for m in model.modules()
               if isinstance(getattr(m, "_commfuse_dropped", None), torch.Tensor)]
    if not counted:
        return None
    total = torch.stack([c.to(counted[0].device) for c in counted]).sum(0)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    for m in model.modules():
        if hasattr(m, "_commfuse_dropped"):
            m._commfuse_dropped = torch.zeros_like(total)
    dropped, rows = total.tolist()
    return dropped / rows if rows else 0.0

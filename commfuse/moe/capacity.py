"""Expert capacity: Megatron-LM's ``moe_expert_capacity_factor`` with its "probs" drop policy.

The token set is one rank's tokens before the dispatch (under TPSP: its sequence shard of
its batch; Megatron counts the same). Of those N tokens' k (token, expert) rows, each expert
keeps at most ``C = ceil(N * k / E * factor)``: the rows of the highest routing weight, ties
to the lower token, then the lower top-k slot. A dropped row contributes nothing to its
token's output (a token whose every row is dropped gets zero from the routed experts) and
its weight gets no gradient. An unsharded model applies the same rule to each rank's chunk
of its tokens (`commfuse.tp.balance.limit_capacity`) and gives the same outputs.
"""

from __future__ import annotations

import math

import torch


def check_factor(factor: float | None) -> float | None:
    """``factor`` as a float, or None (dropless); ValueError unless it is a finite number
    above 0."""
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
            math.isfinite(factor) and factor > 0):
        raise ValueError(f"the expert capacity factor must be a finite number > 0 (None: no "
                         f"capacity, every row reaches its expert), got {factor!r}")
    return float(factor)


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Rows each expert takes of ``tokens`` tokens routed to ``k`` of ``experts``:
    ``ceil(tokens * k / experts * factor)`` (Megatron's ``get_capacity``)."""
    return math.ceil(tokens * k / experts * factor)


def within_capacity(index_Nk: torch.Tensor, weights_Nk: torch.Tensor, experts: int,
                    factor: float) -> torch.Tensor:
    """bool [N, k]: which (token, expert) rows each expert keeps under `capacity` (module
    docstring: highest weight first, ties to the lower token, then the lower slot)."""
    N, k = index_Nk.shape
    C = capacity(N, k, experts, factor)
    e = index_Nk.reshape(-1).long()
    if C >= N * k:  # no expert can overflow
        return torch.ones_like(index_Nk, dtype=torch.bool)
    # rows by expert, then weight (highest first), then flat (token, slot): stable sorts
    by_weight = torch.sort(weights_Nk.detach().reshape(-1), descending=True, stable=True).indices
    rows = by_weight[torch.sort(e[by_weight], stable=True).indices]
    n_E = torch.bincount(e, minlength=experts)
    start_E = n_E.cumsum(0) - n_E
    place = torch.arange(e.numel(), device=e.device) - start_E[e[rows]]
    keep = torch.empty_like(e, dtype=torch.bool)
    keep[rows] = place < C
    return keep.view(N, k)


def count_dropped(module: torch.nn.Module, keep_Nk: torch.Tensor) -> None:
    """Add (dropped rows, rows) to ``module._commfuse_dropped`` in a forward with gradients
    (training; on the routing's device: no host sync), for
    `commfuse.tp.balance.take_dropped`."""
    if torch.is_grad_enabled():
        n = torch.stack([(~keep_Nk).sum(), torch.tensor(keep_Nk.numel(), device=keep_Nk.device)])
        module._commfuse_dropped = getattr(module, "_commfuse_dropped", 0) + n

"""Expert parallelism for `commfuse.moe.layer.MoELayer`: each rank of a process group holds
E/W of the experts and routes its own tokens; the fused ops move them.

Per step, on every rank of the group (its own tokens, any number, zero included):

1. route the tokens (the replicated router, `commfuse.moe.layer.route`): k (token, expert)
   rows per token;
2. plan the step (`commfuse.ops.moe.routing.plan`): the rows sorted by global expert, each
   (token, destination rank) pair marked once, the counts exchanged (one all-gather, the
   layer's one transfer to the host), then each row's routing and weight moved to its
   expert rank (`commfuse.ops.moe.routing.to_experts`);
3. ``h = moe_dispatch_matmul(pairs, w_gate_up)``: the dispatch, one row per (token,
   destination rank), fused with the gate|up GEMM on the rows expanded there to one per
   (token, expert);
4. ``a = swiglu(h)``; ``y = moe_matmul_combine(a, w_down, weights)``: the down GEMM, each
   token's expert rows on the rank weighted and summed in top-k order, fused with the
   combine, which returns one row per (token, rank);
5. the token's output is the sum of its rows from each rank, in top-k order of the ranks
   (`commfuse.ops.moe.routing.home_sum`).

Gradients: the local experts' weight grads are complete on their rank; the router is
replicated, so its grad (this rank's tokens' share) is reduced over the group like any
data-parallel weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from commfuse.moe.layer import MoELayer, route, swiglu
from commfuse.ops.moe import moe_dispatch_matmul, moe_matmul_combine
from commfuse.ops.moe.routing import home_sum, plan, to_experts
from commfuse.schedule.moe import ExpertCounts


class ExpertParallelMoE(nn.Module):
    """``layer`` with its experts sharded over ``group``: rank r holds experts
    r*E_l .. (r+1)*E_l - 1 (E_l = E/W), a copy of the router, and runs the fused ops with
    ``method`` and ``opts`` (`commfuse.ops.moe.moe_dispatch_matmul`'s).

    ``forward(x)`` takes this rank's tokens [..., D] and returns their outputs, equal to
    ``layer(x)`` on the same tokens. ``last_counts``: the previous step's `ExpertCounts`.
    """

    def __init__(self, layer: MoELayer, group: dist.ProcessGroup, *, method: str = "commfuse",
                 **opts):
        super().__init__()
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, "
                            f"got {type(group).__name__}")
        c, w, r = layer.config, group.size(), group.rank()
        if c.experts % w:
            raise ValueError(f"{c.experts} experts cannot be split over {w} ranks")
        local = slice(r * (c.experts // w), (r + 1) * (c.experts // w))
        self.config, self.group, self.method, self.opts = c, group, method, opts
        self.router = nn.Linear(c.dim, c.experts, bias=False, dtype=layer.router.weight.dtype,
                                device=layer.router.weight.device)
        with torch.no_grad():
            self.router.weight.copy_(layer.router.weight)
        self.w_gate_up = nn.Parameter(layer.w_gate_up.detach()[local].clone())
        self.w_down = nn.Parameter(layer.w_down.detach()[local].clone())
        self.last_counts: ExpertCounts | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        weights_Tk, experts_Tk = route(self.router(x_TD), self.config)
        y_TD, self.last_counts = expert_ffn(x_TD, weights_Tk, experts_Tk, self.w_gate_up,
                                            self.w_down, swiglu, self.group, self.config.experts,
                                            method=self.method, **self.opts)
        return y_TD.reshape(x.shape)


def expert_ffn(x_TD: torch.Tensor, weights_Tk: torch.Tensor, experts_Tk: torch.Tensor,
               w_in_EDN: torch.Tensor, w_out_EFD: torch.Tensor, act, group: dist.ProcessGroup,
               experts: int, *, method: str = "commfuse", keep_Tk: torch.Tensor | None = None,
               **opts) -> tuple[torch.Tensor, ExpertCounts]:
    """Steps 2-5 of the module docstring for routed tokens: ``(y [T, D], the step's counts)``.

    ``x_TD`` this rank's tokens; ``experts_Tk`` / ``weights_Tk`` each token's k global experts
    (of ``experts``) and their weights, as the router gave them; ``w_in_EDN`` [E_l, D, N] and
    ``w_out_EFD`` [E_l, F, D] this rank's experts' first and last projections (``x @ w``);
    ``act`` maps the first GEMM's [rows, N] to the last one's [rows, F] (SwiGLU: N = 2F).
    ``y[t] = sum_j weights[t, j] * expert_{e_j}(x[t])``, each product cast to x's dtype before
    the sum (as transformers' MoE blocks add them), in top-k order on each expert rank, then
    the ranks' sums in the order of their first expert. ``keep_Tk`` (bool [T, k], None: all):
    the (token, expert) rows that move; the others are dropped from the sum (and from the
    dispatch: `commfuse.ops.moe.routing.plan`), their weights' gradients zero.
    """
    route = plan(experts_Tk, experts, group, opts.get("timeout"),
                 (tuple(w_in_EDN.shape), tuple(w_out_EFD.shape)), keep_Tk)
    weights_R, routing = to_experts(route, weights_Tk, group, opts.get("timeout"))
    h = moe_dispatch_matmul(x_TD[route.first_tokens], w_in_EDN, route.counts, group,
                            method=method, routing=routing, **opts)
    y = moe_matmul_combine(act(h), w_out_EFD, route.counts, group, method=method,
                           routing=routing, weights=weights_R, **opts)
    return home_sum(route, y).to(x_TD.dtype), route.counts

"""Expert parallelism for `commfuse.moe.layer.MoELayer`: each rank of a process group holds
E/W of the experts and routes its own tokens; the fused ops move them.

Per step, on every rank of the group (its own tokens, any number, zero included):

1. route the tokens (the replicated router, `commfuse.moe.layer.route`), one row per
   (token, chosen expert), sorted by global expert: the send layout;
2. exchange the per-expert counts (`commfuse.ops.moe.counts.exchange_counts`: validated, the
   same table on every rank, before any token moves);
3. ``h = moe_dispatch_matmul(rows, w_gate_up)``: dispatch fused with the gate|up GEMM;
4. ``a = swiglu(h)``; ``y = moe_matmul_combine(a, w_down)``: the down GEMM fused with the
   combine, which returns each row to its token's rank in dispatch order;
5. the token's output is the weighted sum over its k experts, at its home rank, in top-k
   order, as in the reference.

Gradients: the local experts' weight grads are complete on their rank; the router is
replicated, so its grad (this rank's tokens' share) is reduced over the group like any
data-parallel weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from commfuse.moe.layer import MoELayer, route, swiglu
from commfuse.ops.moe import exchange_counts, moe_dispatch_matmul, moe_matmul_combine
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
               experts: int, *, method: str = "commfuse",
               **opts) -> tuple[torch.Tensor, ExpertCounts]:
    """Steps 2-5 of the module docstring for routed tokens: ``(y [T, D], the step's counts)``.

    ``x_TD`` this rank's tokens; ``experts_Tk`` / ``weights_Tk`` each token's k global experts
    (of ``experts``) and their weights, as the router gave them; ``w_in_EDN`` [E_l, D, N] and
    ``w_out_EFD`` [E_l, F, D] this rank's experts' first and last projections (``x @ w``);
    ``act`` maps the first GEMM's [rows, N] to the last one's [rows, F] (SwiGLU: N = 2F).
    ``y[t] = sum_j weights[t, j] * expert_{e_j}(x[t])``, each product cast to x's dtype before
    the sum (as transformers' MoE blocks add them), in top-k order.
    """
    k = experts_Tk.shape[-1]
    flat = experts_Tk.reshape(-1)  # row t*k + j: token t's j-th expert
    order = torch.sort(flat, stable=True).indices  # the send layout: by global expert
    hist = torch.bincount(flat, minlength=experts)
    counts = exchange_counts(hist, group, rows=flat.numel(), timeout=opts.get("timeout"))
    h = moe_dispatch_matmul(x_TD[order // k], w_in_EDN, counts, group, method=method, **opts)
    y = moe_matmul_combine(act(h), w_out_EFD, counts, group, method=method, **opts)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    y_TkD = y[back].reshape(*experts_Tk.shape, y.shape[-1])  # row (t, j) back in place
    return (y_TkD * weights_Tk.unsqueeze(-1)).to(x_TD.dtype).sum(1), counts

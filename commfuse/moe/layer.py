"""A Mixture-of-Experts layer in plain PyTorch: the unsharded reference that expert
parallelism (`commfuse.moe.parallel`) reproduces.

Legend: T tokens, D model width, E experts, k experts per token, F an expert's hidden width.
The router scores every expert per token (`route`: softmax or sigmoid, top-k, renormalised
as Mixtral does); each chosen expert, a SwiGLU MLP, processes the token; the output is the
weighted sum over the token's k experts, in top-k order. No capacity factor: no token is
dropped, however skewed the routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.moe.config import MoEConfig


def route(logits_TE: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, experts [T, k]) of each token's top-k experts,
    best first. Scores in at least float32 (Mixtral's softmax runs in float32); with
    ``config.normalize`` the k chosen scores are divided by their sum."""
    scores = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    scores = scores.softmax(-1) if config.score == "softmax" else scores.sigmoid()
    weights, experts = scores.topk(config.top_k, dim=-1)
    if config.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits_TE.dtype), experts


def swiglu(h_T2F: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the gate|up projection's two halves."""
    gate, up = h_T2F.chunk(2, dim=-1)
    return F.silu(gate) * up


class MoELayer(nn.Module):
    """Router + E SwiGLU experts: ``y = sum_j w_j * expert_{e_j}(x)`` over the token's k.

    Parameters: ``router`` (Linear D -> E, no bias), ``w_gate_up`` [E, D, 2F] (each expert's
    gate and up projections side by side, applied as ``x @ w``), ``w_down`` [E, F, D].
    """

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype | None = None,
                 device=None):
        super().__init__()
        self.config = c = config
        self.router = nn.Linear(c.dim, c.experts, bias=False, dtype=dtype, device=device)
        self.w_gate_up = nn.Parameter(torch.empty(c.experts, c.dim, 2 * c.ffn, dtype=dtype,
                                                  device=device))
        self.w_down = nn.Parameter(torch.empty(c.experts, c.ffn, c.dim, dtype=dtype,
                                               device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, std=self.config.dim ** -0.5)
        nn.init.normal_(self.w_down, std=self.config.ffn ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., D] -> [..., D]; every expert runs once on the tokens that chose it."""
        x_TD = x.reshape(-1, x.shape[-1])
        weights_Tk, experts_Tk = route(self.router(x_TD), self.config)
        y_TkD = x_TD.new_zeros((*experts_Tk.shape, x_TD.shape[-1]))
        for e in range(self.config.experts):
            t, j = torch.where(experts_Tk == e)
            if t.numel():
                h = swiglu(x_TD[t] @ self.w_gate_up[e])
                y_TkD = y_TkD.index_put((t, j), h @ self.w_down[e])
        return (y_TkD * weights_Tk.unsqueeze(-1)).sum(1).reshape(x.shape)

"""A bench workload's step: one forward (and backward) pass of a method, built from its forward."""

from __future__ import annotations

from typing import Callable

import torch

Step = Callable[[str, dict, bool], None]


def grad_step(forward: Callable) -> Step:
    """``step(method, opts, backward)``: runs ``forward(method, opts)``, then its backward with
    ones as the output's gradient, or the forward alone under no_grad."""
    def step(method: str, opts: dict, backward: bool) -> None:
        if backward:
            out = forward(method, opts)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                forward(method, opts)
    return step

"""Gradient sums of replicated parameters posted during the backward and waited at its end.

A parameter replicated over the TP group that sees only this rank's part of the work (a norm
on a sequence shard, MLA's latent projections on this rank's tokens, a router) gets the
gradient of the whole as the sum of every rank's. `commfuse.tp.functional.sum_grad` sums it
where the backward reaches it, an all-reduce the backward waits for. `sum_grad_later` posts
the same all-reduce there and lets the backward go on: the sum travels while the backward
computes the layers before (DDP's overlap, one parameter per all-reduce), and a callback
queued on the autograd engine waits for every posted sum when the backward ends and adds
each into its parameter's ``.grad``.

What the autograd graph gives the parameter in the meantime is zeros, so ``.grad`` is the
previous value (or zeros) until the end of the backward, then that value plus the sum: the
same additions, in the same order, as the blocking sum. Anything that reads ``.grad`` while
the backward runs (a post-accumulate-grad hook, FSDP2's per-layer reduce-scatter) would read
it unsummed: the styles use `sum_grad_later` only for parameters they registered themselves
and still find on the module at forward time (FSDP2's ``fully_shard`` and anything else that
replaces a module's parameters makes them fall back to `sum_grad`), and not under Dynamo
(which traces `sum_grad`'s all-reduce as a functional collective).

Every rank posts the same sums in the same order (the same backward graph), so gloo and NCCL
match them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from commfuse.runtime import deadlines, modes


class _Pending:
    """The sums posted in the current backward: (parameter, work, buffer), and whether the
    engine callback that waits for them is queued."""

    def __init__(self):
        self.sums: list[tuple[torch.nn.Parameter, object, torch.Tensor, object]] = []
        self.queued = False

    def add(self, param, work, buf, group) -> None:
        self.sums.append((param, work, buf, group))
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.queued = True

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every posted sum (in posting order) and add it into its ``.grad``."""
        sums, self.sums, self.queued = self.sums, [], False
        for param, work, buf, group in sums:
            deadlines.wait(work, group, buf.device, None)
            grad = param.grad
            if grad is None:  # no .grad accumulated (torch.autograd.grad): nothing to add to
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.add_(buf)


_PENDING = _Pending()


class _SumGradLater(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, param, group):
        ctx.param, ctx.group = param, group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        if modes.current() == "compute_only":
            return g, None, None  # moving nothing: this rank's term
        buf = g.contiguous().clone()
        # posted now: the sum travels while the backward computes the layers before this one
        work = dist.all_reduce(buf, group=ctx.group, async_op=True)
        _PENDING.add(ctx.param, work, buf, ctx.group)
        return torch.zeros_like(g), None, None


def sum_grad_later(t: torch.Tensor, param: torch.nn.Parameter, group) -> torch.Tensor:
    """``t`` (``param``'s local tensor) unchanged; its gradient summed over ``group`` into
    ``param.grad`` when the backward ends (the all-reduce posted where the backward reaches
    ``t``; module docstring)."""
    return _SumGradLater.apply(t, param, group)

"""The whole expert-parallel FFN (`commfuse.moe.parallel.expert_ffn`) as `torch.library` custom
ops (namespace ``commfuse``), for ``torch.compile``.

    commfuse::moe_expert_ffn(x_TD, weights_Tk, experts_Tk, w_in, w_out, act, group, experts,
                             method, opts, keep, kept_Tk) -> (y_TD, handle)         autograd
    commfuse::moe_expert_ffn_backward(gy_TD, handle, x_TD, weights_Tk, w_in, w_out)
                             -> (gx_TD, gweights_Tk, gw_in, gw_out)                (backward)

Inside, a step's rows per rank and expert are data: the rows each rank receives, the
expanded rows its experts compute, the routing's index tensors. Outside, every shape is
static: the tokens in [T, D], their outputs [T, D], the gradients of the inputs. So the
fake kernels read only the inputs' shapes, and Dynamo keeps the whole call (routing, count
exchange, dispatch -> GEMM, activation, GEMM -> combine, home sum) one node of the graph, in
the forward and the backward.

The forward kernel runs `expert_ffn` eagerly, with autograd on inside it when ``keep`` (the
caller's inputs need gradients): the graph it builds (the `commfuse.ops.moe.autograd`
Functions, the activation, the routing) is kept under an integer ``handle`` (the op's second
output, an int64 tensor [1]) until the backward op runs it, or until the handle is freed (a
forward whose backward never runs). So the compiled model computes what the eager one does,
in the same order, without recomputing the forward.

Arguments a custom op cannot take are passed by name: ``group`` is ``group.group_name``,
``act`` the key of an activation registered with `register_act`, ``opts`` the method's
options as `opts_str` writes them. ``kept_Tk`` (bool [T, k] or None) is a capacity's
mask: the rows it drops are not dispatched (`commfuse.moe.capacity`). ``method`` may be "auto": the MoE ops resolve it inside,
once the step's counts are known, alike on every rank.
"""

from __future__ import annotations

import ast
import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch._C import DispatchKey

from commfuse.ops.library import group_of

Tensor = torch.Tensor


@dataclass(eq=False)
class Act:
    """An activation the op runs between its GEMMs (``act``: [rows, N] -> [rows, F]) and what
    receives each step's `ExpertCounts` (``sink``, or None)."""

    act: Callable[[Tensor], Tensor]
    sink: Callable | None = None


_ACTS: "weakref.WeakValueDictionary[str, Act]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_act(entry: Act) -> str:
    """The key of ``entry`` for the op's ``act`` argument. The registry holds it weakly: the
    caller keeps ``entry`` alive (e.g. on the experts' module) as long as it compiles."""
    key = f"moe_act_{next(_KEYS)}"
    _ACTS[key] = entry
    return key


def opts_str(opts: dict) -> str:
    """A method's options (``chunks``, ``splits``, ``timeout``: literals) as the op's string."""
    return repr(sorted(opts.items()))


@functools.lru_cache(maxsize=None)
def _opts(s: str) -> dict:
    return dict(ast.literal_eval(s))


_STASH: dict[int, tuple] = {}  # handle -> (the leaves, y): a forward's graph awaiting its backward
_HANDLES = itertools.count()


class _AutogradOn:
    """Autograd recording inside a custom op's kernel, which runs below the autograd keys:
    those keys taken off the thread's excluded set, grad mode on."""

    def __enter__(self):
        C = torch._C
        exclude = C._dispatch_tls_local_exclude_set()
        for key in (DispatchKey.AutogradCPU, DispatchKey.AutogradOther,
                    DispatchKey.AutogradNestedTensor):
            exclude = exclude.remove(key)
        self._guards = [C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude),
                        torch.enable_grad()]
        for g in self._guards:
            g.__enter__()

    def __exit__(self, *exc):
        for g in reversed(self._guards):
            g.__exit__(*exc)


@torch.library.custom_op("commfuse::moe_expert_ffn", mutates_args=())
def moe_expert_ffn(x_TD: Tensor, weights_Tk: Tensor, experts_Tk: Tensor, w_in: Tensor,
                   w_out: Tensor, act: str, group: str, experts: int, method: str, opts: str,
                   keep: bool, kept_Tk: Tensor | None = None) -> tuple[Tensor, Tensor]:
    from commfuse.moe.parallel import expert_ffn

    entry = _ACTS[act]
    args = (entry.act, group_of(group), experts)
    handle = torch.full((1,), -1, dtype=torch.long)
    if not keep:
        y, counts = expert_ffn(x_TD, weights_Tk, experts_Tk, w_in, w_out, *args, method=method,
                               keep_Tk=kept_Tk, **_opts(opts))
    else:
        leaves = [t.detach().requires_grad_() for t in (x_TD, weights_Tk, w_in, w_out)]
        with _AutogradOn():
            y, counts = expert_ffn(leaves[0], leaves[1], experts_Tk, leaves[2], leaves[3],
                                   *args, method=method, keep_Tk=kept_Tk, **_opts(opts))
        n = next(_HANDLES)
        _STASH[n] = (leaves, y)
        handle = torch.full((1,), n, dtype=torch.long)
        weakref.finalize(handle, _STASH.pop, n, None)  # no backward: the graph goes with it
    if entry.sink is not None:
        entry.sink(counts)
    return y.detach(), handle


@moe_expert_ffn.register_fake
def _(x_TD, weights_Tk, experts_Tk, w_in, w_out, act, group, experts, method, opts, keep,
      kept_Tk=None):
    return torch.empty_like(x_TD), x_TD.new_empty((1,), dtype=torch.long, device="cpu")


@torch.library.custom_op("commfuse::moe_expert_ffn_backward", mutates_args=())
def moe_expert_ffn_backward(gy_TD: Tensor, handle: Tensor, x_TD: Tensor, weights_Tk: Tensor,
                            w_in: Tensor, w_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of `moe_expert_ffn`'s inputs (x, weights, w_in, w_out): its forward's
    graph (``handle``) run backward from ``gy_TD``; zeros where an input did not reach y."""
    n = int(handle.item())
    if n not in _STASH:
        raise RuntimeError("commfuse::moe_expert_ffn_backward: no forward graph under this "
                           "handle (the forward ran with keep=False, or its backward ran "
                           "already)")
    leaves, y = _STASH.pop(n)
    with _AutogradOn():
        grads = torch.autograd.grad(y, leaves, gy_TD, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads))


@moe_expert_ffn_backward.register_fake
def _(gy_TD, handle, x_TD, weights_Tk, w_in, w_out):
    return tuple(torch.empty_like(t) for t in (x_TD, weights_Tk, w_in, w_out))


def _setup(ctx, inputs, output):
    x_TD, weights_Tk, _, w_in, w_out = inputs[:5]
    ctx.save_for_backward(output[1], x_TD, weights_Tk, w_in, w_out)


def _backward(ctx, gy_TD, _):
    handle, *saved = ctx.saved_tensors
    gx, gweights, gw_in, gw_out = moe_expert_ffn_backward(gy_TD.contiguous(), handle, *saved)
    return gx, gweights, None, gw_in, gw_out, None, None, None, None, None, None, None


moe_expert_ffn.register_autograd(_backward, setup_context=_setup)


def expert_ffn(x_TD: Tensor, weights_Tk: Tensor, experts_Tk: Tensor, w_in: Tensor,
               w_out: Tensor, act: str, group, experts: int, method: str, opts: str,
               kept_Tk: Tensor | None = None) -> Tensor:
    """`commfuse.moe.parallel.expert_ffn`'s output through the custom op (what a caller runs
    under ``torch.compile``); ``act`` a `register_act` key, ``opts`` an `opts_str`."""
    keep = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_TD, weights_Tk, w_in, w_out))
    y, _ = moe_expert_ffn(x_TD, weights_Tk, experts_Tk, w_in, w_out, act, group.group_name,
                          experts, method, opts, keep, kept_Tk)
    return y

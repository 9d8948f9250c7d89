"""`ExpertParallel`: a transformers sparse MoE block's experts split over the ranks of a mesh,
the dispatch and combine all-to-alls fused with the expert GEMMs (`commfuse.moe.parallel`).
The whole-model plans that use it: `commfuse.tp.plan` (Mixtral, Qwen3-MoE) and
`commfuse.tp.hf_mamba` (Nemotron-H's MoE layers)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from commfuse.moe.parallel import expert_ffn
from commfuse.ops.methods import method_spec
from commfuse.tp.functional import gather_cols
from commfuse.tp.sequence import SeqSplit, SequenceParallelNorm


def expert_weights(block: nn.Module) -> tuple[str, str] | None:
    """The names of a transformers sparse MoE block's expert weights, or None when ``block``
    is not one: a ``gate`` router with a ``weight`` [E, D] and ``experts`` with a fused
    ``gate_up_proj`` [E, 2F, D] (SwiGLU experts: Mixtral, Qwen3-MoE) or an ``up_proj``
    [E, F, D] (non-gated experts: Nemotron-H), and ``down_proj`` [E, D, F]."""
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    if not isinstance(getattr(gate, "weight", None), nn.Parameter):
        return None
    for first in ("gate_up_proj", "up_proj"):
        if all(isinstance(getattr(experts, n, None), nn.Parameter) and getattr(experts, n).dim() == 3
               for n in (first, "down_proj")):
            return first, "down_proj"
    return None


def is_sparse(block: nn.Module) -> bool:
    """Whether ``block`` is a transformers sparse MoE block (`expert_weights`)."""
    return expert_weights(block) is not None


# a sparse block's dense parts, run on this rank's tokens beside the routed experts:
# Nemotron-H's shared experts and latent projections (replicated by `ExpertParallel` when
# named in its ``replicate``, else sharded by the model's plan)
DENSE = ("shared_experts", "fc1_latent_proj", "fc2_latent_proj")


def _recording_router_logits() -> bool:
    """Whether transformers is recording router logits for the running forward (the aux
    loss); True when this transformers version does not say (the gather is then always
    done: the loss stays exact, a small all-gather per layer is spent)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return True
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


class ExpertParallel(ParallelStyle):
    """A transformers sparse MoE block (`expert_weights`) with its experts split over the
    mesh: ``experts.gate_up_proj`` (or ``up_proj``) and ``experts.down_proj`` become
    ``Shard(0)`` DTensors (E/T experts per rank), the router's ``gate.weight`` a ``Replicate``
    one whose gradient is summed over the mesh (each rank routes its own tokens; a router's
    buffers, such as Nemotron-H's score-correction bias, stay as they are), and so do the
    block's dense parts named in ``replicate`` (default ``DENSE``: Nemotron-H's shared experts
    and latent projections; a plan that shards the shared experts itself leaves them out).
    ``forward(hidden_states [B, s, D])`` runs the block's own router on this rank's tokens,
    then `commfuse.moe.parallel.expert_ffn` with ``method`` and ``opts``
    (`commfuse.ops.moe.moe_dispatch_matmul`'s) and the experts' activation (gated on
    gate|up, else ``act_fn``), then the dense parts as the block does; the experts' module
    keeps the step's `ExpertCounts` as ``last_counts``. ``split``: the `SeqSplit` of the
    model's plan (the router logits of every rank's shard are gathered in its order).
    """

    def __init__(self, *, split: SeqSplit | None = None, method: str = "auto",
                 replicate: tuple[str, ...] = DENSE, **opts):
        method_spec(method, opts)  # a bad method or option fails here, before any forward
        unknown = set(replicate) - set(DENSE)
        if unknown:
            raise ValueError(f"replicate takes names from {DENSE}, got {sorted(unknown)}")
        self.split, self.method, self.opts = split, method, opts
        self.replicate = tuple(replicate)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = expert_weights(module)
        if names is None:
            raise TypeError(f"ExpertParallel applies to a sparse MoE block (gate.weight, "
                            f"experts.gate_up_proj or experts.up_proj, experts.down_proj), got "
                            f"{type(module).__name__}")
        T, experts = device_mesh.size(), module.experts
        E = getattr(experts, names[0]).shape[0]
        if E % T:
            raise ValueError(f"{E} experts cannot be split over {T} ranks")
        for name in names:
            p = getattr(experts, name)
            experts.register_parameter(name, nn.Parameter(
                distribute_tensor(p.detach(), device_mesh, [Shard(0)]), p.requires_grad))
        experts.last_counts = None
        parallelize_module(module.gate, device_mesh, SequenceParallelNorm())
        for name in self.replicate:  # each submodule with parameters: replicated, grads summed
            sub = getattr(module, name, None)
            for part in (sub.modules() if isinstance(sub, nn.Module) else ()):
                if next(part.parameters(recurse=False), None) is not None:
                    parallelize_module(part, device_mesh, SequenceParallelNorm())
        group = device_mesh.get_group()
        module.gate.forward = functools.partial(self._route, module.gate.forward, group)
        module.forward = functools.partial(self._forward, module, group, E, names[0])
        return module

    def _route(self, route, group, hidden_states: torch.Tensor):
        """The block's router on ``hidden_states`` [B, s, D] (its weight's gradient summed
        over the group); its logits gathered over the sequence while they are recorded."""
        logits, weights, index = route(hidden_states)
        if _recording_router_logits():
            (B, s, _), E = hidden_states.shape, logits.shape[-1]
            sizes = (self.split.sizes if self.split is not None and self.split.sizes
                     else (s,) * group.size())
            logits_BEs = logits.reshape(B, s, E).transpose(1, 2)
            logits = gather_cols(logits_BEs, sizes, group).transpose(1, 2).reshape(-1, E)
        return logits, weights, index

    def _forward(self, module: nn.Module, group, E: int, first: str,
                 hidden_states: torch.Tensor):
        experts = module.experts
        _, weights, index = module.gate(hidden_states)
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        shared, latent_in, latent_out = (getattr(module, n, None) for n in DENSE)
        if latent_in is not None:  # Nemotron-H: the experts may work in a latent width
            x_TD = latent_in(x_TD)

        def gated(h):  # the model's gated activation on gate|up
            gate, up = h.chunk(2, dim=-1)
            return experts.act_fn(gate) * up

        y_TD, experts.last_counts = expert_ffn(
            x_TD, weights, index, getattr(experts, first).to_local().transpose(1, 2),
            experts.down_proj.to_local().transpose(1, 2),
            gated if first == "gate_up_proj" else experts.act_fn, group, E,
            method=self.method, **self.opts)
        if latent_out is not None:
            y_TD = latent_out(y_TD)
        y = y_TD.reshape(hidden_states.shape)
        return y if shared is None else y + shared(hidden_states)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.method!r}, {self.opts})"

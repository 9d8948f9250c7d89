"""`ExpertParallel`: a transformers sparse MoE block's experts split over the ranks of a mesh,
the dispatch and combine all-to-alls fused with the expert GEMMs (`commfuse.moe.parallel`).
`commfuse.tp.plan`'s derived plan sets it on every block `is_sparse` recognises.

A block is described by transformers' experts interface (`use_experts_implementation`): an
``experts`` module with 3-D ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` [E, ...],
optional ``*_bias`` [E, ...], the flags ``is_transposed`` / ``has_gate`` / ``has_bias`` and
the gated activation ``_apply_gate``, called as ``experts(x [N, D], top_k_index [N, k],
top_k_weights [N, k])``; beside it a router (``gate`` or ``router``) whose ``weight`` is
[E, D]. The block's own forward runs unchanged: its router (group-limited routing, score
corrections, routed scaling: the model's code) on this rank's tokens, its shared experts and
gates as the model's plan splits them; only the experts' forward is replaced.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from commfuse.moe.capacity import check_factor, count_dropped, within_capacity
from commfuse.moe.parallel import expert_ffn
from commfuse.ops.methods import method_spec
from commfuse.ops.moe import library as moe_library
from commfuse.ops.moe.library import Act, register_act
from commfuse.tp.functional import gather_cols, scale_grad
from commfuse.tp.sequence import SeqSplit, SequenceParallelNorm, as_sequence

ROUTERS = ("gate", "router")  # the names a block's router goes by


def router_logits_index(model: nn.Module) -> int:
    """Which output of the routers transformers records as ``router_logits``."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    return getattr(recorders.get("router_logits"), "index", 0) or 0


@dataclass(frozen=True)
class ExpertsSpec:
    """How a sparse block holds its experts: the ``router`` child's name, the first weight
    (``gate_up_proj``: gated, or ``up_proj``), the expert count, whether weights are stored
    ``x @ w`` (``transposed``) rather than ``F.linear``'s [E, out, in], whether they carry
    biases, whether each expert's output is normed (``post_norm``), and whether the experts
    take routed tokens (``x, top_k_index, top_k_weights``: ``routed``)."""

    router: str
    first: str
    experts: int
    transposed: bool = False
    bias: bool = False
    post_norm: bool = False
    routed: bool = True
    unknown: tuple[str, ...] = ()  # the experts' parameters this layout does not name

    @property
    def gated(self) -> bool:
        return self.first == "gate_up_proj"


def _params(experts: nn.Module) -> list[str]:
    """The experts' forward's argument names after ``self`` (through decorators)."""
    try:
        return list(inspect.signature(type(experts).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def expert_spec(block: nn.Module) -> ExpertsSpec | None:
    """The `ExpertsSpec` of a transformers sparse MoE block, or None when ``block`` is not
    one (no ``experts`` with 3-D expert weights and a router of as many rows beside it)."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        return None
    is3d = lambda n: isinstance(getattr(experts, n, None), nn.Parameter) and getattr(  # noqa: E731
        experts, n).dim() == 3
    first = next((n for n in ("gate_up_proj", "up_proj") if is3d(n)), None)
    if first is None or not is3d("down_proj"):
        return None
    E = getattr(experts, first).shape[0]
    router = next((n for n in ROUTERS if isinstance(getattr(getattr(block, n, None), "weight", None),
                                                    nn.Parameter)
                   and getattr(block, n).weight.dim() == 2
                   and getattr(block, n).weight.shape[0] == E), None)
    if router is None:
        return None
    transposed = getattr(experts, "is_transposed", None)
    if transposed is None:  # no flag: [E, D, N] when only that reading fits the router's D
        D, (w, down) = getattr(block, router).weight.shape[1], (getattr(experts, first),
                                                               experts.down_proj)
        transposed = w.shape[1] == D and down.shape[2] == D and (w.shape[2], down.shape[1]) != (
            D, D)
    bias = bool(getattr(experts, "has_bias", False))
    known = {first, "down_proj", *((f"{first}_bias", "down_proj_bias") if bias else ())}
    return ExpertsSpec(router, first, E, transposed=bool(transposed), bias=bias,
                       post_norm=bool(getattr(experts, "has_post_expert_norm", False)),
                       routed=len(_params(experts)) >= 3,
                       unknown=tuple(sorted(n for n, _ in experts.named_parameters()
                                            if n not in known)))


def is_sparse(block: nn.Module) -> bool:
    """Whether ``block`` is a transformers sparse MoE block (`expert_spec`)."""
    return expert_spec(block) is not None


def spec_problems(spec: ExpertsSpec, T: int) -> list[str]:
    """Why the experts of ``spec`` cannot be split over ``T`` ranks (empty: they can)."""
    problems = []
    if not spec.routed and (spec.bias or not spec.gated):
        problems.append("experts that take every token scaled by its router score (Llama 4's "
                        "layout) are built for bias-free gate|up experts only")
    if spec.unknown:
        problems.append(f"expert parameters {list(spec.unknown)} that its layout (has_bias="
                        f"{spec.bias}) does not use")
    if spec.post_norm:
        problems.append("a norm after each expert: not built")
    if spec.experts % T:
        problems.append(f"{spec.experts} experts cannot be split over {T} ranks (expert "
                        f"parallelism needs the experts divisible by the TP size)")
    return problems


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
    """A transformers sparse MoE block (`expert_spec`) with its experts split over the mesh:
    every expert parameter (weights and biases) a ``Shard(0)`` DTensor (E/T experts per
    rank), the router's parameters ``Replicate`` with their gradients summed over the mesh
    (each rank routes its own tokens; a router's buffers, such as a score-correction bias,
    stay as they are). The block's forward is its own; ``experts(x, top_k_index,
    top_k_weights)`` becomes `commfuse.moe.parallel.expert_ffn` with ``method`` and ``opts``
    (`commfuse.ops.moe.moe_dispatch_matmul`'s) and the experts' activation (``_apply_gate``
    on gate|up, else ``act_fn``), biases folded into the GEMMs as a row of ones; the
    experts' module keeps the step's `ExpertCounts` as ``last_counts``. The block's other
    children (shared experts, their gates), planned by the model's plan, see a token-flat
    ``[B*s, D]`` input as ``[B, s, D]`` (the fused styles split dim 1). ``split``: the
    `SeqSplit` of the model's plan (recorded router logits are gathered in its order).
    ``capacity_factor`` (None: dropless): each expert takes at most ceil(N k / E * factor)
    of the rows of this rank's N tokens, the rest dropped (`commfuse.moe.capacity`).
    """

    def __init__(self, *, split: SeqSplit | None = None, method: str = "auto",
                 logits_index: int = 0, ep_mesh: DeviceMesh | None = None,
                 capacity_factor: float | None = None, **opts):
        method_spec(method, opts)  # a bad method or option fails here, before any forward
        self.split, self.method, self.opts = split, method, opts
        self.capacity_factor = check_factor(capacity_factor)
        self._opts_str = moe_library.opts_str(opts)
        self.logits_index = logits_index
        if ep_mesh is not None and tuple(ep_mesh.mesh_dim_names or ()) != ("ep_replicate", "ep"):
            raise ValueError("ep_mesh is commfuse.tp.mesh.ep_mesh's (ep_replicate, ep) mesh")
        self.ep_mesh = ep_mesh

    def ranks(self, tp: int) -> int:
        """The ranks the experts are split over: the ``ep`` dim of ``ep_mesh``, else the TP
        group's ``tp``."""
        return tp if self.ep_mesh is None else self.ep_mesh["ep"].size()

    def problems(self, spec: ExpertsSpec, tp: int) -> list[str]:
        """Why this style cannot split the experts of ``spec`` (`spec_problems` over
        `ranks`); empty: it can."""
        problems = spec_problems(spec, self.ranks(tp))
        if self.capacity_factor is not None and not spec.routed:
            problems.append("an expert capacity for experts that take every token scaled by "
                            "its router score (Llama 4's layout): not built")
        return problems

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        spec = expert_spec(module)
        if spec is None:
            raise TypeError(f"ExpertParallel applies to a sparse MoE block (experts with 3-D "
                            f"gate_up_proj or up_proj and down_proj, a router gate or router "
                            f"with a weight [E, D]), got {type(module).__name__}")
        experts = module.experts
        emesh = device_mesh if self.ep_mesh is None else self.ep_mesh["ep"]
        problems = self.problems(spec, device_mesh.size())
        if problems:
            raise ValueError(f"{type(module).__name__}: " + "; ".join(problems))
        for name, p in list(experts.named_parameters(recurse=False)):
            if p.shape[0] != spec.experts:  # a per-expert layout names none such
                raise ValueError(f"{type(experts).__name__}.{name} {tuple(p.shape)} is not "
                                 f"per expert ([{spec.experts}, ...])")
            experts.register_parameter(name, nn.Parameter(
                distribute_tensor(p.detach(), emesh, [Shard(0)]), p.requires_grad))
        experts.last_counts = None
        # beyond the TP group: each expert's gradient sums every EP rank's tokens, each
        # rank's under its own batch's loss; summed over the groups that hold the same
        # experts and divided by the data-parallel size, it is the data-parallel mean the
        # other weights get (FSDP2 averages them over "dp"; these it must leave alone:
        # `expert_parameters`)
        experts._commfuse_ep = None if self.ep_mesh is None else (
            device_mesh.size() / self.ep_mesh.mesh.numel(),
            self.ep_mesh["ep_replicate"].get_group() if self.ep_mesh.size(0) > 1 else None)
        router = getattr(module, spec.router)
        parallelize_module(router, device_mesh, SequenceParallelNorm())
        group, shape = device_mesh.get_group(), {}  # the TP group: this layer's sequence
        module._commfuse_seq_group = group  # for `commfuse.tp.router_loss`

        def remember(_, args, kwargs):  # the block's [B, s, D] input, for its children
            x = args[0] if args else kwargs.get("hidden_states")
            shape["tokens"] = None if x is None else tuple(x.shape[:-1])

        module.register_forward_pre_hook(remember, with_kwargs=True)
        skip = {"experts", spec.router}
        for name, child in module.named_children():
            if name not in skip and next(child.parameters(), None) is not None:
                as_sequence(child, shape)
        router.forward = functools.partial(self._route, router.forward, shape, group)
        # the activation, and where a compiled forward leaves its counts (`_experts`)
        experts._commfuse_act = Act(_activation(experts, spec),
                                    functools.partial(setattr, experts, "last_counts"))
        experts._commfuse_act_key = register_act(experts._commfuse_act)
        experts.forward = functools.partial(self._experts, experts, spec, emesh.get_group(),
                                            _params(experts))
        if not spec.routed:
            module.forward = functools.partial(_scaled_forward, module, spec)
        return module

    def _route(self, route, shape: dict, group, hidden_states: torch.Tensor, *args, **kwargs):
        """The block's router on this rank's tokens (its parameters' gradients summed over the
        group); its logits (first output) gathered over the sequence while recorded."""
        out = route(hidden_states, *args, **kwargs)
        tokens = shape.get("tokens")
        if (not isinstance(out, tuple) or not _recording_router_logits() or tokens is None
                or len(tokens) != 2):
            return out
        (B, s), i = tokens, self.logits_index
        E = out[i].shape[-1]
        sizes = (self.split.sizes if self.split is not None and self.split.sizes
                 else (s,) * group.size())
        logits_BEs = out[i].reshape(B, s, E).transpose(1, 2)
        logits = gather_cols(logits_BEs, sizes, group).transpose(1, 2).reshape(-1, E)
        return (*out[:i], logits, *out[i + 1:])

    def _experts(self, experts: nn.Module, spec: ExpertsSpec, group, names: list[str],
                 *args, **kwargs) -> torch.Tensor:
        if spec.routed:
            bound = {**dict(zip(names, args)), **kwargs}
            x_TD, index, weights = (bound[n] for n in names[:3])
        else:  # from _scaled_forward: each row one (token, expert) pair, already scaled
            x_TD, index, weights = args
        def local(name: str) -> torch.Tensor:
            t = getattr(experts, name).to_local()
            return t if experts._commfuse_ep is None else scale_grad(t, *experts._commfuse_ep)

        w_in, w_out = local(spec.first), local("down_proj")
        if not spec.transposed:  # F.linear's [E, out, in] -> x @ w's [E, in, out]
            w_in, w_out = w_in.transpose(1, 2), w_out.transpose(1, 2)
        if spec.bias:  # x @ w + b as [x, 1] @ [w; b]: each expert's bias in its GEMM
            b_in, b_out = local(f"{spec.first}_bias"), local("down_proj_bias")
            w_in = torch.cat([w_in, b_in.unsqueeze(1)], 1)
            w_out = torch.cat([w_out, b_out.unsqueeze(1)], 1)
            x_TD = _ones_column(x_TD)
        keep = None
        if self.capacity_factor is not None:
            keep = within_capacity(index, weights, spec.experts, self.capacity_factor)
            count_dropped(experts, keep)
        if torch.compiler.is_compiling():  # one opaque custom op, forward and backward
            return moe_library.expert_ffn(x_TD, weights, index, w_in, w_out,
                                          experts._commfuse_act_key, group, spec.experts,
                                          self.method, self._opts_str, keep)
        y_TD, experts.last_counts = expert_ffn(x_TD, weights, index, w_in, w_out,
                                               experts._commfuse_act.act, group, spec.experts,
                                               method=self.method, keep_Tk=keep, **self.opts)
        return y_TD

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.method!r}, {self.opts})"


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights `ExpertParallel` split beyond the TP group (``ep_mesh``): data
    parallelism must leave them out (``fully_shard(..., ignored_params=...)``); their
    gradients are already the data-parallel mean."""
    return {p for m in model.modules() if getattr(m, "_commfuse_ep", None) is not None
            for p in m.parameters(recurse=False)}


def _scaled_forward(block: nn.Module, spec: ExpertsSpec, hidden_states: torch.Tensor):
    """Llama 4's MoE block, its experts on routed rows: the router's scores [N, E] (the
    sigmoid of the top-k logits, zero elsewhere) scale each token before its k experts, the
    routed outputs summed, the shared expert added; returns ``(out, router_logits)`` as the
    block does."""
    x_ND = hidden_states.reshape(-1, hidden_states.shape[-1])
    scores_NE, logits = getattr(block, spec.router)(x_ND)
    k = block.top_k
    scores_Nk, index_Nk = scores_NE.topk(k, dim=-1)  # the chosen experts: the nonzero scores
    rows = (x_ND.unsqueeze(1) * scores_Nk.unsqueeze(-1)).reshape(-1, x_ND.shape[-1])
    ones = scores_Nk.new_ones(rows.shape[0], 1)
    routed = block.experts(rows, index_Nk.reshape(-1, 1), ones).reshape(-1, k, x_ND.shape[-1])
    out = block.shared_expert(x_ND) + routed.sum(1)
    return out, logits


def _activation(experts: nn.Module, spec: ExpertsSpec):
    """The experts' activation between their GEMMs: ``_apply_gate`` on gate|up (transformers'
    SwiGLU halves where the module has none), else ``act_fn``; with biases, a column of
    ones appended for the down projection's bias row."""
    if spec.gated:
        apply_gate = getattr(experts, "_apply_gate", None) or _swiglu(experts)
    else:
        apply_gate = experts.act_fn
    if spec.bias:
        return lambda h: _ones_column(apply_gate(h))
    return apply_gate


def _ones_column(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], -1)


def _swiglu(experts: nn.Module):
    def gate(h):  # transformers' default: act(gate) * up on the halves of gate|up
        g, up = h.chunk(2, dim=-1)
        return experts.act_fn(g) * up
    return gate

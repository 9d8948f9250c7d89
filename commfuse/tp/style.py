"""Parallel styles for `torch.distributed.tensor.parallel.parallelize_module` whose linears run
commfuse's fused ops (Megatron TPSP: sequence-sharded activations between the TP regions).

    FusedColwiseParallel   nn.Linear, weight/bias Shard(0): sequence shard in, full sequence
                           of this rank's output columns out: fused_all_gather_matmul
    FusedRowwiseParallel   nn.Linear, weight Shard(1), bias Replicate: full sequence of this
                           rank's input columns in, sequence shard out: fused_matmul_reduce_scatter
    FusedProjections       on the parent of several column-parallel linears that read the same
                           input (q|k|v, gate|up): ONE fused all-gather with all their weights;
                           the parent gets the gathered input, each linear its cached output
    PlanStyles             the styles one whole-model plan shares (`plan_styles`)

The styles without a GEMM (norms, the embedding, the first layer's shard, the `SeqSplit` they
share) are in `commfuse.tp.sequence`. Parameters are DTensors on the (1-D) TP mesh, so
`torch.distributed.checkpoint` and FSDP2 see their placements; the forward uses their local
tensors (``to_local()``) and the mesh's ProcessGroup. The styles replace ``module.forward``
(reading the parameters at call time, as FSDP2 swaps them) and keep every module's own code
otherwise. While the `SeqSplit` is ``replicated`` (a decode step of generation: every rank
holds every token), a column-parallel linear is a local GEMM and a row-parallel one a local
GEMM closed by an all-reduce.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from commfuse.ops.fused import fused_all_gather_matmul, fused_matmul_reduce_scatter
from commfuse.ops.methods import method_spec
from commfuse.ops.prefetch import Prefetcher
from commfuse.tp.functional import all_sum, chunk_sizes, gather_cols, sum_grad
from commfuse.tp.sequence import SeqSplit, SequenceParallelNorm, _mesh_group, _param


def _even(module: nn.Module, dim: int, group) -> bool:
    """Whether every rank's shard of ``module.weight`` (a DTensor ``Shard(dim)``) is as wide
    as this rank's: the fused ops then choose their method from the real local shape."""
    return module.weight.shape[dim] % group.size() == 0


class _Fused(ParallelStyle):
    """What the fused styles share: the method and its options, the sequence dim and split,
    and ``prefetch``, a `commfuse.ops.prefetch.Prefetcher` shared by the model's styles (each
    row-parallel linear's backward posts the re-gather of the projections before it ahead)."""

    def __init__(self, *, method: str = "auto", sequence_dim: int = 1, split: SeqSplit | None = None,
                 prefetch: Prefetcher | None = None, **opts):
        method_spec(method, opts)  # a bad method or option fails here, before any forward
        self.op_kwargs, self.dim, self.split = {"method": method, **opts}, sequence_dim, split
        self.prefetch = prefetch

    @property
    def sizes(self):
        return None if self.split is None else self.split.sizes

    def _install(self, module: nn.Module, mesh: DeviceMesh, forward) -> nn.Module:
        module.forward = functools.partial(forward, module, mesh.get_group())
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.op_kwargs}, sequence_dim={self.dim})"


class FusedColwiseParallel(_Fused):
    """Column-parallel ``nn.Linear``: weight and bias ``Shard(0)`` (rank r owns output columns
    chunk r). Input: this rank's sequence shard ``[.., s, .., K]``; output: the full sequence
    of its columns ``[.., S, .., N/T]``, i.e. ``all_gather(x) @ W_r^T + b_r`` in one fused
    call (the gather hides behind the GEMM slices). Backward: the fused reduce-scatter of
    ``dY @ W_r`` (input), local ``dW_r``, ``db_r``.

    ``gather_output=True`` (an output head whose result every rank needs whole) all-gathers
    the columns afterwards: ``[.., S, .., N]`` on every rank. ``replicas=k``: the output
    columns are T/k blocks (kv head groups) each held by k consecutive ranks (GQA with fewer
    kv heads than ranks); the parameter is the block-repeated weight ``[k * out, K]`` and the
    gradients of one block's copies are summed, so the copies stay equal under any optimizer.
    ``rows``: a packed projection (Phi-3's q|k|v, gate|up) whose rank-r rows are not one
    contiguous block of the weight: the model rows every rank holds, in rank order (T equal
    blocks); the parameter is ``Shard(0)`` of ``W[rows]`` (`commfuse.tp.attention.unpack_rows` maps it back).
    ``save_gathered=True`` keeps the gathered input for backward, as DTensor's styles do
    (`commfuse.fused_all_gather_matmul`): more memory, one gather fewer in backward.
    """

    def __init__(self, *, gather_output: bool = False, replicas: int = 1,
                 rows: torch.Tensor | None = None, save_gathered: bool = False, **kw):
        super().__init__(**kw)
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive int, got {replicas!r}")
        if rows is not None and replicas > 1:
            raise ValueError("rows and replicas > 1 do not combine")
        self.gather_output, self.replicas = gather_output, replicas
        self.rows = None if rows is None else torch.as_tensor(rows, dtype=torch.long)
        self.op_kwargs["save_gathered"] = save_gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedColwiseParallel applies to nn.Linear, got {type(module).__name__}")
        _mesh_group(device_mesh)
        T, k = device_mesh.size(), self.replicas
        if T % k:
            raise ValueError(f"replicas ({k}) must divide the mesh size ({T})")
        if k > 1 and module.out_features % (T // k):
            raise ValueError(f"out_features ({module.out_features}) must be divisible by "
                             f"mesh size / replicas ({T // k}) to replicate its blocks")
        if self.rows is not None and len(self.rows) % T:
            raise ValueError(f"rows ({len(self.rows)}) must split into {T} equal blocks")
        for name in ("weight", "bias"):
            p = getattr(module, name)
            if p is not None:
                t = p.detach()
                if self.rows is not None:
                    t = t[self.rows]
                if k > 1:  # blocks b0 b1 .. -> b0 b0 b1 b1 .. (k copies each)
                    t = t.reshape(T // k, -1, *t.shape[1:]).repeat_interleave(k, 0).flatten(0, 1)
                module.register_parameter(name, _param(t, device_mesh, Shard(0), p.requires_grad))
        module._commfuse_colwise = self
        return self._install(module, device_mesh, self._forward)

    def local(self, module: nn.Module, group) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's ``(W_r^T [K, n], b_r or None)``, in the autograd graph."""
        w, b = module.weight.to_local(), module.bias
        b = None if b is None else b.to_local()
        if self.replicas > 1:
            slot, slots = group.rank() // self.replicas, group.size() // self.replicas
            w = sum_grad(w, group, slot, slots)
            b = None if b is None else sum_grad(b, group, slot, slots)
        return w.t(), b

    def _forward(self, module: nn.Module, group, x: torch.Tensor) -> torch.Tensor:
        shared = getattr(module, "_commfuse_shared", None)
        y = shared.take(module, x) if shared is not None else None
        if y is None:
            w, b = self.local(module, group)
            if self.split is not None and self.split.replicated:
                y = x @ w  # every token here: a local GEMM
            else:
                _, (y,) = fused_all_gather_matmul(x, [w], self.dim, group, return_A=False,
                                                  sizes=self.sizes,
                                                  uniform_b=_even(module, 0, group),
                                                  **self.op_kwargs)
            y = y if b is None else y + b
        if not self.gather_output:
            return y
        return gather_cols(y, chunk_sizes(module.weight.shape[0], group.size()), group)


class _Shared:
    """The gathered input of one parent call and its projections' outputs, each taken once."""

    def __init__(self):
        self.input: torch.Tensor | None = None
        self.outs: dict[int, torch.Tensor] = {}

    def take(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return self.outs.pop(id(module), None) if x is self.input else None

    def clear(self) -> None:
        self.input, self.outs = None, {}


class FusedProjections(_Fused):
    """On a module (attention, MLP) whose submodules ``names`` are `FusedColwiseParallel`
    linears reading the module's input: before the module runs, ONE fused call all-gathers
    that input (its first positional argument, else keyword ``input_kwarg``) with every
    projection's weight (``all_gather(x) @ [Wq_r^T, Wk_r^T, Wv_r^T]``), replaces the input
    by the gathered one (so code that reshapes by the input's length sees the full sequence)
    and caches each output; a projection called on that gathered tensor returns its cached
    output, one called on anything else runs its own fused call. The cache is dropped when
    the module returns. Backward: one fused reduce-scatter summing every projection's term.
    ``save_gathered``: as for `FusedColwiseParallel`."""

    def __init__(self, names, *, input_kwarg: str = "hidden_states", save_gathered: bool = False,
                 **kw):
        super().__init__(**kw)
        self.op_kwargs["save_gathered"] = save_gathered
        if isinstance(names, str) or not names:
            raise TypeError(f"names must be a non-empty list of submodule names, got {names!r}")
        self.names, self.input_kwarg = tuple(names), input_kwarg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = _mesh_group(device_mesh)
        shared = _Shared()
        children = []
        for name in self.names:
            child = module.get_submodule(name)
            if not isinstance(child, nn.Linear):
                raise TypeError(f"FusedProjections: {name} is {type(child).__name__}, not nn.Linear")
            child._commfuse_shared = shared
            children.append((name, child))
        uniform = all(_even(c, 0, group) for _, c in children)

        def pre(mod, args, kwargs):
            if self.split is not None and self.split.replicated:
                return None  # every token here: each projection's local GEMM
            if args:
                x = args[0]
            elif self.input_kwarg in kwargs:
                x = kwargs[self.input_kwarg]
            else:
                raise ValueError(f"FusedProjections: {type(mod).__name__} got no positional input "
                                 f"and no {self.input_kwarg!r} keyword")
            ws, bs = [], []
            for name, child in children:
                style = getattr(child, "_commfuse_colwise", None)
                if style is None:
                    raise TypeError(f"FusedProjections: {name} has no FusedColwiseParallel style")
                w, b = style.local(child, group)
                ws.append(w)
                bs.append(b)
            a, ys = fused_all_gather_matmul(x, ws, self.dim, group, return_A=True,
                                            sizes=self.sizes, uniform_b=uniform,
                                            prefetch=self.prefetch, **self.op_kwargs)
            shared.input = a
            shared.outs = {id(c): y if b is None else y + b for (_, c), y, b in zip(children, ys, bs)}
            if args:
                return (a, *args[1:]), kwargs
            return args, {**kwargs, self.input_kwarg: a}

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(lambda *_: shared.clear())
        return module


class FusedRowwiseParallel(_Fused):
    """Row-parallel ``nn.Linear``: weight ``Shard(1)`` (rank r owns input columns chunk r),
    bias ``Replicate``. Input: the full sequence of this rank's columns ``[.., S, .., K/T]``;
    output: this rank's sequence shard ``reduce_scatter(x @ W_r^T) + b`` ``[.., s, .., N]``
    in one fused call (each partial's transfer hides behind the next slice's GEMM); the bias
    is added once, after the reduce-scatter, and its gradient summed over TP. Backward: the
    fused all-gather of ``dY`` with ``W_r`` (input) and ``dW_r`` from the same gather."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedRowwiseParallel applies to nn.Linear, got {type(module).__name__}")
        _mesh_group(device_mesh)
        w = module.weight
        module.register_parameter("weight", _param(w, device_mesh, Shard(1), w.requires_grad))
        if module.bias is not None:
            b = module.bias
            module.register_parameter("bias", _param(b, device_mesh, Replicate(), b.requires_grad))
        return self._install(module, device_mesh, self._forward)

    def _forward(self, module: nn.Module, group, x: torch.Tensor) -> torch.Tensor:
        w = module.weight.to_local()
        if self.split is not None and self.split.replicated:  # every token here: all-reduce
            y = all_sum(x @ w.t(), group)
            return y if module.bias is None else y + module.bias.to_local()
        # backward: posts the re-gather of the projections before it (prefetch) ahead
        y = fused_matmul_reduce_scatter(x, w.t(), "sum", self.dim, group, sizes=self.sizes,
                                        uniform_b=_even(module, 1, group),
                                        prefetch=self.prefetch, **self.op_kwargs)
        # contiguous, as nn.Linear's output is (the op returns [s, B, N] moved to [B, s, N]):
        # the model's code may .view it, and its elementwise ops keep a permuted layout
        # (Beam's depth-scaled residual into its MoE block's .view)
        y = y.contiguous()
        return y if module.bias is None else y + sum_grad(module.bias.to_local(), group)


class PlanStyles(NamedTuple):
    """The styles a whole-model plan (`commfuse.tp.parallelize`'s) shares: one sequence
    split and one prefetch chain for every layer, the op options ``kw`` (``ag``: with
    ``save_gathered``, for the all-gather -> GEMM styles), and the column, row and norm
    styles built from them."""

    split: SeqSplit
    chain: Prefetcher
    kw: dict
    ag: dict
    col: FusedColwiseParallel
    row: FusedRowwiseParallel
    norm: SequenceParallelNorm


def plan_styles(method: str, save_gathered: bool, prefetch: bool, opts: dict,
                defer_grad_sums: bool = False) -> PlanStyles:
    """`PlanStyles` for ``method`` and its ``opts``; ``prefetch``: the row styles post the
    next layer's all-gather early (a chain of depth 1); ``defer_grad_sums``: the norms'
    (`SequenceParallelNorm`'s ``defer_sums``)."""
    split, chain = SeqSplit(), Prefetcher(1 if prefetch else 0)
    kw = dict(method=method, split=split, **opts)
    ag = dict(kw, save_gathered=save_gathered)
    return PlanStyles(split, chain, kw, ag, FusedColwiseParallel(**ag),
                      FusedRowwiseParallel(prefetch=chain, **kw),
                      SequenceParallelNorm(defer_grad_sums))

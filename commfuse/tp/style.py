"""Parallel styles for `torch.distributed.tensor.parallel.parallelize_module` whose linears run
commfuse's fused ops (Megatron TPSP: sequence-sharded activations between the TP regions).

    FusedColwiseParallel   nn.Linear, weight/bias Shard(0): sequence shard in, full sequence
                           of this rank's output columns out: fused_all_gather_matmul
    FusedRowwiseParallel   nn.Linear, weight Shard(1), bias Replicate: full sequence of this
                           rank's input columns in, sequence shard out: fused_matmul_reduce_scatter
    FusedProjections       on the parent of several column-parallel linears that read the same
                           input (q|k|v, gate|up): ONE fused all-gather with all their weights;
                           the parent gets the gathered input, each linear its cached output
    SequenceParallelNorm   replicated parameters (Replicate) on a shard of the activations
                           (norms; q_norm/k_norm on a head group): gradients summed over TP
    ReplicateParallel      replicated parameters, the same work on every rank (the embedding)
    ShardSequence          slices a module's replicated input to this rank's sequence shard

Parameters are DTensors on the (1-D) TP mesh, so `torch.distributed.checkpoint` and FSDP2
see their placements; the forward uses their local tensors (``to_local()``) and the mesh's
ProcessGroup. The styles replace ``module.forward`` (reading the parameters at call time, as
FSDP2 swaps them) and keep every module's own code otherwise. A ``SeqSplit`` shared by the
styles carries the current sequence split (set by `ShardSequence`; None: even shards).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from commfuse.ops.binding import even_sizes
from commfuse.ops.fused import fused_all_gather_matmul, fused_matmul_reduce_scatter
from commfuse.ops.methods import method_spec
from commfuse.ops.prefetch import Prefetcher
from commfuse.tp.functional import chunk_sizes, gather_cols, shard_seq, sum_grad


class SeqSplit:
    """The split of the current forward's sequence over the TP ranks (``sizes``: rows per rank,
    `commfuse.even_sizes` of the length), written by `ShardSequence`, read by the fused styles.
    ``sizes`` None means every rank's shard is as long as this rank's."""

    def __init__(self):
        self.sizes: tuple[int, ...] | None = None


def _mesh_group(mesh: DeviceMesh):
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"the commfuse.tp styles need a 1-D DeviceMesh (the 'tp' dim of a larger "
                         f"one: mesh['tp']), got {mesh!r}")
    return mesh.get_group()


def _param(t: torch.Tensor, mesh: DeviceMesh, placement, requires_grad: bool) -> nn.Parameter:
    # distribute_tensor takes rank 0's values (src_data_rank), so all ranks hold one model
    return nn.Parameter(distribute_tensor(t.detach(), mesh, [placement]), requires_grad)


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
            _, (y,) = fused_all_gather_matmul(x, [w], self.dim, group, return_A=False,
                                              sizes=self.sizes, uniform_b=_even(module, 0, group),
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
        # backward: posts the re-gather of the projections before it (prefetch) ahead
        y = fused_matmul_reduce_scatter(x, w.t(), "sum", self.dim, group, sizes=self.sizes,
                                        uniform_b=_even(module, 1, group),
                                        prefetch=self.prefetch, **self.op_kwargs)
        return y if module.bias is None else y + sum_grad(module.bias.to_local(), group)


class ReplicateParallel(ParallelStyle):
    """Every parameter ``Replicate``d on the mesh; the module's own forward runs on their local
    tensors. ``sum_grads=False`` (this class): every rank does the same work, so the gradients
    are already whole (the embedding, ahead of `ShardSequence`)."""

    sum_grads = False

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_group(device_mesh)
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, _param(p, device_mesh, Replicate(), p.requires_grad))
        forward = module.forward  # the module's own (bound) forward, run with local parameters
        group, sum_grads = device_mesh.get_group(), self.sum_grads

        def local_forward(*args, **kwargs):
            params = module._parameters
            saved = dict(params)
            try:
                for name, p in saved.items():
                    if p is not None:
                        t = p.to_local()
                        params[name] = sum_grad(t, group) if sum_grads else t
                return forward(*args, **kwargs)
            finally:
                params.update(saved)

        module.forward = local_forward
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SequenceParallelNorm(ReplicateParallel):
    """A norm (or any module with replicated parameters) on a shard of the activations: its
    sequence shard (Megatron's sequence-parallel LayerNorm/RMSNorm), or the head group of
    q_norm/k_norm. Parameters ``Replicate``; each rank's gradient covers its shard only, so
    it is summed over TP in the backward (one all-reduce per parameter)."""

    sum_grads = True


class ShardSequence(ParallelStyle):
    """Slice the module's input (first positional argument, else keyword ``input_kwarg``),
    replicated on every rank, to this rank's sequence shard: `commfuse.even_sizes` of its
    length along ``sequence_dim`` (any length: 10 over 4 ranks is 3, 3, 2, 2), recorded in
    ``split``. The backward all-gathers the shards' gradients (the module before it ran the
    same on every rank). With ``prefetch`` (the fused styles' `Prefetcher`), a gather posted
    ahead in a backward that did not use it is waited out here, as the model's forward begins.
    With ``partial`` (a `commfuse.tp.embedding.Partial`: tied embeddings), an input derived
    from the vocabulary-parallel embedding's partial output is reduce-scattered instead
    (summed over the ranks onto the sequence shards)."""

    def __init__(self, split: SeqSplit | None = None, *, sequence_dim: int = 1,
                 input_kwarg: str = "hidden_states", prefetch: Prefetcher | None = None,
                 partial=None):
        self.split = SeqSplit() if split is None else split
        self.dim, self.input_kwarg, self.prefetch = sequence_dim, input_kwarg, prefetch
        self.partial = partial

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = _mesh_group(device_mesh)

        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs.get(self.input_kwarg)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"ShardSequence: {type(mod).__name__} got no tensor input")
            if self.prefetch is not None:
                self.prefetch.drain()
            self.split.sizes = sizes = even_sizes(x.shape[self.dim], group.size())
            summed = None if self.partial is None else self.partial.shard(
                x, self.dim, sizes, group, type(mod).__name__)
            x = shard_seq(x, self.dim, sizes, group) if summed is None else summed
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, self.input_kwarg: x})

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"ShardSequence(sequence_dim={self.dim})"


"""The TPSP styles without a GEMM, and the sequence split the styles share.

    SeqSplit               the current forward's split of the sequence over the TP ranks
                           (``sizes``), or ``replicated``: every rank holds every token
    SequenceParallelNorm   replicated parameters (Replicate) on a shard of the activations
                           (norms; q_norm/k_norm on a head group): gradients summed over TP
    ReplicateParallel      replicated parameters, the same work on every rank (the embedding)
    HeadParameters         an attention's per-head parameters (sinks) split with its heads
    ShardSequence          slices a module's replicated input to this rank's sequence shard;
                           without gradients and with fewer tokens than ranks (a decode step)
                           it leaves every token on every rank (``replicated``)
    as_sequence            a sparse block's child, called on the flattened tokens, sees them
                           as the block's [B, s, D]
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
from torch.compiler import is_compiling as compiling
from torch.distributed.tensor.parallel import ParallelStyle

from commfuse.ops.binding import even_sizes
from commfuse.ops.prefetch import Prefetcher
from commfuse.tp.functional import all_gather_dim, shard_seq, sum_grad, sum_grad_later


class SeqSplit:
    """The split of the current forward's sequence over the TP ranks (``sizes``: rows per rank,
    `commfuse.even_sizes` of the length), written by `ShardSequence`, read by the fused styles.
    ``sizes`` None means every rank's shard is as long as this rank's. ``replicated``: this
    forward keeps every token on every rank (a decode step; from the model's last norm on,
    in any forward without gradients: `gather_final`)."""

    def __init__(self):
        self.sizes: tuple[int, ...] | None = None
        self.replicated = False


def _mesh_group(mesh: DeviceMesh):
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"the commfuse.tp styles need a 1-D DeviceMesh (the 'tp' dim of a larger "
                         f"one: mesh['tp']), got {mesh!r}")
    return mesh.get_group()


def _param(t: torch.Tensor, mesh: DeviceMesh, placement, requires_grad: bool) -> nn.Parameter:
    # distribute_tensor takes rank 0's values (src_data_rank), so all ranks hold one model
    return nn.Parameter(distribute_tensor(t.detach(), mesh, [placement]), requires_grad)


class ReplicateParallel(ParallelStyle):
    """Every parameter ``Replicate``d on the mesh; the module's own forward runs on their local
    tensors. ``sum_grads=False`` (this class): every rank does the same work, so the gradients
    are already whole (the embedding, ahead of `ShardSequence`)."""

    sum_grads = False
    defer_sums = False
    placement = Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_group(device_mesh)
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, _param(p, device_mesh, self.placement,
                                                   p.requires_grad))
        forward = module.forward  # the module's own (bound) forward, run with local parameters
        group, sum_grads = device_mesh.get_group(), self.sum_grads
        defer = sum_grads and self.defer_sums
        ours = {name: p for name, p in module._parameters.items() if p is not None}

        def local_forward(*args, **kwargs):
            params = module._parameters
            saved = dict(params)
            try:
                for name, p in saved.items():
                    if p is not None:
                        t = p.to_local()
                        if defer and ours.get(name) is p and not compiling():
                            t = sum_grad_later(t, p, group)  # the sum overlaps the backward
                        elif sum_grads:  # a parameter put there since (FSDP2's), or traced
                            t = sum_grad(t, group)  # by Dynamo: the sum waited here
                        params[name] = t
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
    it is summed over TP in the backward (one all-reduce per parameter, waited where the
    backward reaches it; ``defer_sums=True``: posted there and added when the backward ends,
    `commfuse.tp.functional.sum_grad_later`, for a training loop that reads ``.grad`` only
    after ``backward()``)."""

    sum_grads = True

    def __init__(self, defer_sums: bool = False):
        super().__init__()
        self.defer_sums = defer_sums


class HeadParameters(ReplicateParallel):
    """An attention's own parameters of one value per head (gpt-oss's sinks) split with its
    heads: ``Shard(0)``, so this rank's forward reads the rows of its heads; each rank's
    gradient is its rows' whole gradient."""

    placement = Shard(0)


class ShardSequence(ParallelStyle):
    """Slice the module's input (first positional argument, else keyword ``input_kwarg``),
    replicated on every rank, to this rank's sequence shard: `commfuse.even_sizes` of its
    length along ``sequence_dim`` (any length: 10 over 4 ranks is 3, 3, 2, 2), recorded in
    ``split``. The backward all-gathers the shards' gradients (the module before it ran the
    same on every rank). With ``prefetch`` (the fused styles' `Prefetcher`), a gather posted
    ahead in a backward that did not use it is waited out here, as the model's forward begins.
    With ``partial`` (a `commfuse.tp.embedding.Partial`: tied embeddings), an input derived
    from the vocabulary-parallel embedding's partial output is reduce-scattered instead
    (summed over the ranks onto the sequence shards). Without gradients and with fewer
    tokens than ranks (a decode step), the input stays whole on every rank (summed, if
    partial) and ``split.replicated`` tells the fused styles (``decode``: plans whose every
    style has a replicated path)."""

    def __init__(self, split: SeqSplit | None = None, *, sequence_dim: int = 1,
                 input_kwarg: str = "hidden_states", prefetch: Prefetcher | None = None,
                 partial=None, decode: bool = False):
        self.split = SeqSplit() if split is None else split
        self.dim, self.input_kwarg, self.prefetch = sequence_dim, input_kwarg, prefetch
        self.partial, self.decode = partial, decode

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = _mesh_group(device_mesh)

        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs.get(self.input_kwarg)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"ShardSequence: {type(mod).__name__} got no tensor input")
            if self.prefetch is not None:
                self.prefetch.drain()
            replicated = (self.decode and not torch.is_grad_enabled()
                          and x.shape[self.dim] < group.size())
            self.split.replicated = replicated
            self.split.sizes = sizes = even_sizes(x.shape[self.dim], group.size())
            summed = None if self.partial is None else self.partial.shard(
                x, self.dim, None if replicated else sizes, group, type(mod).__name__)
            if summed is not None:
                x = summed
            elif not replicated:
                x = shard_seq(x, self.dim, sizes, group)
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, self.input_kwarg: x})

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"ShardSequence(sequence_dim={self.dim})"



def gather_final(base: nn.Module, split: SeqSplit, group, dim: int = 1) -> None:
    """After ``base`` (a transformers base model whose output's ``last_hidden_state`` is
    sequence-sharded), in a forward without gradients: all-gather that output over the
    sequence and mark ``split`` replicated, so the model's own code after it (generation's
    ``logits_to_keep`` slice of the last positions) sees every token, and the head runs on
    them locally."""

    def hook(mod, args, out):
        if torch.is_grad_enabled() or split.replicated or split.sizes is None:
            return out
        h = out[0] if isinstance(out, tuple) else out.last_hidden_state
        h = all_gather_dim(h, dim, split.sizes, group)
        split.replicated = True
        if isinstance(out, tuple):
            return (h, *out[1:])
        out.last_hidden_state = h
        return out

    base.register_forward_hook(hook)


def as_sequence(child: nn.Module, shape: dict) -> None:
    """``child`` called with its block's tokens flattened, ``[B*s, D]`` (``shape["tokens"]``:
    the block's ``(B, s)``, kept by its pre-hook: `commfuse.tp.experts.ExpertParallel`),
    sees them as the block's ``[B, s, D]`` (before any other hook: the fused styles split
    dim 1) and returns them flat again."""
    flat = {}

    def pre(_, args, kwargs):
        tokens = shape.get("tokens")
        x = args[0] if args else None
        flat["on"] = (tokens is not None and x is not None and x.dim() == 2
                      and len(tokens) == 2 and x.shape[0] == tokens[0] * tokens[1])
        if flat["on"]:
            return (x.reshape(*tokens, x.shape[-1]), *args[1:]), kwargs
        return None

    def post(_, args, kwargs, out):
        if flat.pop("on", False) and isinstance(out, torch.Tensor):
            return out.reshape(-1, out.shape[-1])
        return None

    child.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    child.register_forward_hook(post, with_kwargs=True, prepend=True)

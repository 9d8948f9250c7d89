"""The fused ops as `torch.library` custom ops (namespace ``commfuse``), for ``torch.compile``.

Under compilation the public functions of `commfuse.ops.fused` call these instead of their
autograd Functions, so each fused call stays one opaque node of the graph (Dynamo cannot trace
a schedule of asynchronous P2P transfers, and must not decompose it). Eager calls keep the
Functions: the same kernels, without the custom-op dispatch.

    commfuse::ag_matmul(a_sMK, bs_KN, sizes, group, spec) -> [a_SMK, *ys_SMN]   autograd
    commfuse::matmul_rs(a_SMK, b_KN, avg, sizes, group, spec) -> c_sMN            autograd
    commfuse::matmul_a2a(a_sMK, b_KN, sizes, group, spec) -> y_SMn               autograd
    commfuse::a2a_matmul(a_SMk, b_KN, keep_x, sizes, group, spec) -> (y_sMN, x)  autograd
    commfuse::matmul_rs_terms(xs, bs, extra, sizes, group, spec) -> c_sMN        (backward only)

(`commfuse::query_split_attention` is registered by `commfuse.ops.attention`, with these
helpers.)

Every op works in the layout of the kernels, the gathered/scattered/sequence dim first (the
wrapper moves it); the legends of `commfuse.ops.gather_scatter` and `commfuse.ops.all_to_all`
apply. A ProcessGroup cannot be an op argument: ``group`` is its name (``group.group_name``,
resolved with torch's registry), ``spec`` a concrete `MethodSpec` as JSON (``method="auto"``
is resolved before, in the wrapper, identically on every rank). The fake kernels give the
output shapes from the inputs, ``sizes`` and the group size. The backward formulas are the
Functions' (`ag_matmul_backward`, ...), run on these ops, so the backward is in the graph too.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from commfuse.ops import all_to_all as a2a
from commfuse.ops import gather_scatter as gs
from commfuse.ops.ag_matmul import ag_matmul as _ag_kernel
from commfuse.ops.matmul_rs import matmul_rs as _rs_kernel
from commfuse.ops.methods import MethodSpec

Tensor = torch.Tensor


_FIELDS = {"method": str, "topology": str, "chunks": int, "timeout": float,
           "collective": str, "splits": int}


def spec_str(spec: MethodSpec) -> str:
    """``spec`` as the string argument of the ops, ``method=commfuse;topology=ring;...``
    (plain string formatting, which Dynamo traces); the method must be concrete."""
    if spec.method == "auto":
        raise ValueError("method='auto' must be resolved before calling a commfuse custom op")
    return ";".join([f"{name}={getattr(spec, name)}" for name in _FIELDS])


@functools.lru_cache(maxsize=None)
def parse_spec(s: str) -> MethodSpec:
    """The `MethodSpec` of a `spec_str` string."""
    pairs = dict(item.split("=", 1) for item in s.split(";"))
    if set(pairs) != set(_FIELDS):
        raise ValueError(f"not a commfuse method spec: {s!r}")
    return MethodSpec(**{k: None if v == "None" else _FIELDS[k](v) for k, v in pairs.items()})


def group_of(name: str):
    """The ProcessGroup of ``name`` (``group.group_name``)."""
    return _resolve_process_group(name)


def world_of(name: str) -> int:
    return group_of(name).size()


def rank_of(name: str) -> int:
    return group_of(name).rank()


# --- all-gather -> GEMM ----------------------------------------------------------------------

@torch.library.custom_op("commfuse::ag_matmul", mutates_args=())
def ag_matmul(a_sMK: Tensor, bs_KN: list[Tensor], sizes: list[int], group: str,
              spec: str) -> list[Tensor]:
    a_SMK, ys_SMN = _ag_kernel(a_sMK, list(bs_KN), tuple(sizes), group_of(group),
                               parse_spec(spec))
    return [a_SMK, *ys_SMN]


@ag_matmul.register_fake
def _(a_sMK, bs_KN, sizes, group, spec):
    S, rest = sum(sizes), a_sMK.shape[1:]
    return [a_sMK.new_empty((S, *rest)), *(a_sMK.new_empty((S, *rest[:-1], b.shape[1]))
                                           for b in bs_KN)]


def _ag_setup(ctx, inputs, output):
    a_sMK, bs_KN, sizes, group, spec = inputs
    ctx.save_for_backward(output[0], *bs_KN)
    ctx.sizes, ctx.group, ctx.spec = tuple(sizes), group, spec


def _ag_backward(ctx, grads):
    a_SMK, *bs_KN = ctx.saved_tensors
    ga_SMK, *gys_SMN = grads
    ga_sMK, gbs = gs.saved_ag_matmul_backward(a_SMK, bs_KN, ga_SMK, gys_SMN, ctx.sizes,
                                              ctx.group, ctx.spec, ctx.needs_input_grad[0],
                                              [ctx.needs_input_grad[1]] * len(bs_KN), KERNELS)
    return ga_sMK, gbs, None, None, None


ag_matmul.register_autograd(_ag_backward, setup_context=_ag_setup)


# --- GEMM -> reduce-scatter ------------------------------------------------------------------

@torch.library.custom_op("commfuse::matmul_rs_terms", mutates_args=())
def matmul_rs_terms(xs_SMK: list[Tensor], bs_KN: list[Tensor], extra_SMN: Tensor | None,
                    sizes: list[int], group: str, spec: str) -> Tensor:
    """``reduce_scatter(sum_i xs[i] @ bs[i] + extra, 0)``: the input grad of ag_matmul."""
    return _rs_kernel(list(zip(xs_SMK, bs_KN)), extra_SMN, tuple(sizes), group_of(group),
                      parse_spec(spec))


@matmul_rs_terms.register_fake
def _(xs_SMK, bs_KN, extra_SMN, sizes, group, spec):
    x = xs_SMK[0]
    return x.new_empty((sizes[rank_of(group)], *x.shape[1:-1], bs_KN[0].shape[1]))


@torch.library.custom_op("commfuse::matmul_rs", mutates_args=())
def matmul_rs(a_SMK: Tensor, b_KN: Tensor, avg: bool, sizes: list[int], group: str,
              spec: str) -> Tensor:
    c_sMN = _rs_kernel([(a_SMK, b_KN)], None, tuple(sizes), group_of(group), parse_spec(spec))
    return c_sMN.div_(world_of(group)) if avg else c_sMN


@matmul_rs.register_fake
def _(a_SMK, b_KN, avg, sizes, group, spec):
    return a_SMK.new_empty((sizes[rank_of(group)], *a_SMK.shape[1:-1], b_KN.shape[1]))


def _rs_setup(ctx, inputs, output):
    a_SMK, b_KN, avg, sizes, group, spec = inputs
    ctx.save_for_backward(a_SMK, b_KN)
    ctx.avg, ctx.sizes, ctx.group, ctx.spec = avg, tuple(sizes), group, spec


def _rs_backward(ctx, gc_sMN):
    a_SMK, b_KN = ctx.saved_tensors
    ga, gb = gs.gathered_matmul_rs_backward(a_SMK, b_KN, gc_sMN, ctx.avg, ctx.sizes, ctx.group,
                                            ctx.spec, ctx.needs_input_grad[1], KERNELS)
    return ga, gb, None, None, None, None


matmul_rs.register_autograd(_rs_backward, setup_context=_rs_setup)


# --- GEMM <-> all-to-all ---------------------------------------------------------------------

@torch.library.custom_op("commfuse::matmul_a2a", mutates_args=())
def matmul_a2a(a_sMK: Tensor, b_KN: Tensor, sizes: list[int], group: str, spec: str) -> Tensor:
    return a2a.matmul_a2a(a_sMK, b_KN, tuple(sizes), group_of(group), parse_spec(spec))


@matmul_a2a.register_fake
def _(a_sMK, b_KN, sizes, group, spec):
    return a_sMK.new_empty((sum(sizes), *a_sMK.shape[1:-1], b_KN.shape[1] // world_of(group)))


def _ma_setup(ctx, inputs, output):
    a_sMK, b_KN, sizes, group, spec = inputs
    ctx.save_for_backward(a_sMK, b_KN)
    ctx.sizes, ctx.group, ctx.spec = tuple(sizes), group, spec


def _ma_backward(ctx, gy_SMn):
    a_sMK, b_KN = ctx.saved_tensors
    ga, gb = a2a.matmul_a2a_backward(a_sMK, b_KN, gy_SMn, ctx.sizes, ctx.group, ctx.spec,
                                     ctx.needs_input_grad[1], KERNELS)
    return ga, gb, None, None, None


matmul_a2a.register_autograd(_ma_backward, setup_context=_ma_setup)


@torch.library.custom_op("commfuse::a2a_matmul", mutates_args=())
def a2a_matmul(a_SMk: Tensor, b_KN: Tensor, keep_x: bool, sizes: list[int], group: str,
               spec: str) -> tuple[Tensor, Tensor]:
    """``(all_to_all(a) @ b, x)``, x the exchanged input ``[s, M, W*k]`` if ``keep_x`` (for
    dB, and the input grad of matmul_a2a), else an empty tensor."""
    y_sMN, binding = a2a.a2a_matmul(a_SMk, b_KN, tuple(sizes), group_of(group),
                                    parse_spec(spec))
    return y_sMN, binding.gathered() if keep_x else a_SMk.new_empty(0)


@a2a_matmul.register_fake
def _(a_SMk, b_KN, keep_x, sizes, group, spec):
    s, rest = sizes[rank_of(group)], a_SMk.shape[1:-1]
    x = a_SMk.new_empty((s, *rest, world_of(group) * a_SMk.shape[-1])) if keep_x else \
        a_SMk.new_empty(0)
    return a_SMk.new_empty((s, *rest, b_KN.shape[1])), x


def _am_setup(ctx, inputs, output):
    a_SMk, b_KN, keep_x, sizes, group, spec = inputs
    ctx.save_for_backward(b_KN, output[1] if keep_x else None)
    ctx.sizes, ctx.group, ctx.spec = tuple(sizes), group, spec


def _am_backward(ctx, gy_sMN, gx):
    b_KN, x = ctx.saved_tensors
    ga, gb = a2a.a2a_matmul_backward(b_KN, x, gy_sMN, ctx.sizes, ctx.group, ctx.spec, KERNELS)
    return ga, gb, None, None, None, None


a2a_matmul.register_autograd(_am_backward, setup_context=_am_setup)


def _kernel_ag(a_sMK, bs_KN, sizes, group, spec):
    a_SMK, *ys = ag_matmul(a_sMK, list(bs_KN), list(sizes), group, spec)
    return a_SMK, ys


def _kernel_rs(terms, extra_SMN, sizes, group, spec):
    xs, bs = zip(*terms)
    return matmul_rs_terms(list(xs), list(bs), extra_SMN, list(sizes), group, spec)


def _kernel_a2a_matmul(a_SMk, b_KN, sizes, group, spec, keep_x=True):
    return a2a_matmul(a_SMk, b_KN, keep_x, list(sizes), group, spec)


# The kernels the shared backward formulas run, as these ops (group: name, spec: string).
KERNELS = types.SimpleNamespace(
    ag_matmul=_kernel_ag, matmul_rs=_kernel_rs,
    matmul_a2a=lambda a, b, sizes, group, spec: matmul_a2a(a, b, list(sizes), group, spec),
    a2a_matmul=_kernel_a2a_matmul, world=world_of)


# --- what the public functions call under torch.compile (A's dim moved first and back) -------

def all_gather_matmul(a_shard, bs, dim: int, sizes, group, spec) -> list[Tensor]:
    a_SMK, *ys = ag_matmul(a_shard.movedim(dim, 0), list(bs), list(sizes), group.group_name,
                           spec_str(spec))
    return [a_SMK.movedim(0, dim), *(y.movedim(0, dim) for y in ys)]


def matmul_reduce_scatter(a, b, dim: int, avg: bool, sizes, group, spec) -> Tensor:
    return matmul_rs(a.movedim(dim, 0), b, avg, list(sizes), group.group_name,
                     spec_str(spec)).movedim(0, dim)


def matmul_all_to_all(a, b, dim: int, sizes, group, spec) -> Tensor:
    return matmul_a2a(a.movedim(dim, 0), b, list(sizes), group.group_name,
                      spec_str(spec)).movedim(0, dim)


def all_to_all_matmul(a, b, dim: int, sizes, group, spec) -> Tensor:
    keep_x = torch.is_grad_enabled() and b.requires_grad  # X only for dB
    y, _ = a2a_matmul(a.movedim(dim, 0), b, keep_x, list(sizes), group.group_name,
                      spec_str(spec))
    return y.movedim(0, dim)

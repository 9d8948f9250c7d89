"""The public fused ops. Signatures follow PyTorch's ``torch.ops.symm_mem.fused_*`` so async-TP
users recognise them, but they run on any torch.distributed backend, with no symmetric memory.

Every op takes ``method`` = "none" | "sliced" (option ``chunks``, default 4) | "decompose" |
"commfuse" (option ``topology`` = "ring" | "direct") | "auto" (`commfuse.ops.auto`: the fastest of
them on the cost model, per shape), and every method takes ``timeout``
(seconds; default: the process group's timeout). All are differentiable in A and every B.

Contract between ranks: every rank of the group calls the same op with the same method, A of
the same shape but for the gathered/scattered/sequence dim, and the same ``sizes``. The ops
that take this rank's slice (AG->GEMM, GEMM->a2a) assume, without ``sizes``, that every
rank's slice is as long as this one; the ops that take the whole dim (GEMM->RS, a2a->GEMM)
need it equally long on every rank. By default this is not checked (checking costs a
collective per call): a violation may end in the backend's error, an abort, a timeout or a
wrong-length result. ``check=True`` (or the environment variable ``COMMFUSE_CHECK=1``)
exchanges every rank's shapes and ``sizes`` once per call (one small all-gather) and raises
`commfuse.errors.ShapeMismatchError` on every rank, naming the op and the ranks that differ.
"""

from __future__ import annotations

from typing import Sequence

import torch

from commfuse.ops import auto, checks, library
from commfuse.ops.all_to_all import AllToAllMatmul, MatmulAllToAll
from commfuse.ops.gather_scatter import AllGatherMatmul, MatmulReduceScatter
from commfuse.ops.methods import method_spec
from commfuse.ops.prefetch import Prefetcher


def fused_all_gather_matmul(A_shard: torch.Tensor, Bs: Sequence[torch.Tensor], gather_dim: int,
                            group=None, *, return_A: bool = True, method: str = "commfuse",
                            sizes: Sequence[int] | None = None, save_gathered: bool = False,
                            uniform_b: bool = True, check: bool | None = None,
                            prefetch: Prefetcher | None = None,
                            **opts) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``A = all_gather(A_shard, gather_dim)``; returns ``(A or None, [A @ B for B in Bs])``.

    ``gather_dim`` is any dim of ``A_shard`` but the last; each rank passes its own ``Bs``
    (its column shards of the weights), each ``[k, n_i]``. ``sizes``: the rows every rank's
    shard has along ``gather_dim`` (the same list on every rank) when they differ; default:
    all equal to this rank's. Only ``A_shard`` is saved for backward, which gathers A again
    (fused, same method, the weight-grad GEMMs consuming it); ``save_gathered=True`` saves
    the gathered A instead (more memory until backward, one gather fewer). ``uniform_b``:
    every rank's Bs have the same columns as this rank's (even column shards); pass False
    where they differ, so that ``auto`` and commfuse's default m decide on a shape every rank
    shares (`commfuse.ops.auto.resolve`). ``check``: checked mode (see the module docstring).
    ``prefetch``: a `commfuse.ops.prefetch.Prefetcher` shared with the fused ops around this
    one; the next fused op given it posts this op's backward gather ahead, from its own
    backward (ignored under torch.compile and with ``save_gathered``).
    """
    checks.check_tensor("A_shard", A_shard)
    _prefetcher(prefetch)
    _flag("save_gathered", save_gathered)
    if isinstance(Bs, torch.Tensor) or not isinstance(Bs, (list, tuple)) or not Bs:
        raise TypeError("Bs must be a non-empty list or tuple of 2-D tensors")
    for i, b in enumerate(Bs):
        checks.check_matmul("A_shard", A_shard, f"Bs[{i}]", b)
    dim = checks.check_dim("gather_dim", gather_dim, "A_shard", A_shard)
    spec = method_spec(method, opts)
    group = checks.resolve_group(group)
    if checks.checked(check):
        checks.agree_shapes("ag_matmul", group, A_shard, dim, sizes, whole=False,
                            timeout=spec.timeout)
    sizes = checks.check_sizes(sizes, group.size(), group.rank(), local=A_shard.shape[dim])
    rows = sum(sizes) * checks.other_rows(A_shard, dim)  # the same on every rank (for auto)
    spec = auto.resolve(spec, "ag_matmul", (rows, A_shard.shape[-1], sum(b.shape[1] for b in Bs)),
                        group.size(), A_shard, group, uniform=_flag("uniform_b", uniform_b))
    if torch.compiler.is_compiling():  # one opaque custom op (it saves the gathered A)
        a, *ys = library.all_gather_matmul(A_shard, Bs, dim, sizes, group, spec)
    else:
        a, *ys = AllGatherMatmul.apply(A_shard, dim, sizes, group, spec, save_gathered,
                                       prefetch, *Bs)
    return (a if return_A else None), ys


def fused_matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str,
                                scatter_dim: int, group=None, *, method: str = "commfuse",
                                sizes: Sequence[int] | None = None, uniform_b: bool = True,
                                check: bool | None = None, prefetch: Prefetcher | None = None,
                                **opts) -> torch.Tensor:
    """``reduce_scatter(A @ B, scatter_dim)`` with ``reduce_op`` "sum" or "avg".

    ``scatter_dim`` is any dim of ``A`` but the last. Returns this rank's slice: ``sizes[rank]``
    rows, ``sizes`` defaulting to `commfuse.even_sizes` (10 rows over 4 ranks: 3, 3, 2, 2).
    ``uniform_b``: every rank's B has as many rows as this rank's (even row shards); pass False
    where they differ (see `fused_all_gather_matmul`). ``check``: checked mode (see the
    module docstring). ``prefetch``: a `commfuse.ops.prefetch.Prefetcher`; this op's backward
    posts ahead the gather of the AG->GEMM given it just before (ignored under torch.compile).
    """
    checks.check_tensor("A", A)
    _prefetcher(prefetch)
    checks.check_matmul("A", A, "B", B)
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    dim = checks.check_dim("scatter_dim", scatter_dim, "A", A)
    spec = method_spec(method, opts)
    group = checks.resolve_group(group)
    if checks.checked(check):
        checks.agree_shapes("matmul_rs", group, A, dim, sizes, whole=True, b_cols=B.shape[1],
                            timeout=spec.timeout)
    sizes = checks.check_sizes(sizes, group.size(), group.rank(), total=A.shape[dim])
    spec = auto.resolve(spec, "matmul_rs", (A.numel() // max(A.shape[-1], 1), *B.shape),
                        group.size(), A, group, uniform=_flag("uniform_b", uniform_b))
    if torch.compiler.is_compiling():
        return library.matmul_reduce_scatter(A, B, dim, reduce_op == "avg", sizes, group, spec)
    return MatmulReduceScatter.apply(A, B, dim, reduce_op == "avg", sizes, group, spec, prefetch)


def fused_matmul_all_to_all(A: torch.Tensor, B: torch.Tensor, group=None, *, seq_dim: int = 0,
                            method: str = "commfuse", sizes: Sequence[int] | None = None,
                            check: bool | None = None, **opts) -> torch.Tensor:
    """Ulysses, before attention: ``all_to_all(A @ B)``.

    ``A`` is this rank's sequence slice (``seq_dim``), ``B`` is ``[k, n]`` with ``n`` divisible
    by the group size. Returns the full sequence of this rank's column block (head group).
    ``sizes``: every rank's sequence slice length when they differ (default: all equal to
    this rank's). ``check``: checked mode (see the module docstring).
    """
    checks.check_tensor("A", A)
    checks.check_matmul("A", A, "B", B)
    dim = checks.check_dim("seq_dim", seq_dim, "A", A)
    spec = method_spec(method, opts)
    group = checks.resolve_group(group)
    checks.check_divisible("B.shape[1] (columns to scatter)", B.shape[1], group.size())
    if checks.checked(check):
        checks.agree_shapes("matmul_a2a", group, A, dim, sizes, whole=False, b_cols=B.shape[1],
                            timeout=spec.timeout)
    sizes = checks.check_sizes(sizes, group.size(), group.rank(), local=A.shape[dim])
    rows = sum(sizes) * checks.other_rows(A, dim)
    spec = auto.resolve(spec, "matmul_a2a", (rows, *B.shape), group.size(), A, group)
    if torch.compiler.is_compiling():
        return library.matmul_all_to_all(A, B, dim, sizes, group, spec)
    return MatmulAllToAll.apply(A, B, dim, sizes, group, spec)


def fused_all_to_all_matmul(A: torch.Tensor, B: torch.Tensor, group=None, *, seq_dim: int = 0,
                            method: str = "commfuse", sizes: Sequence[int] | None = None,
                            check: bool | None = None, **opts) -> torch.Tensor:
    """Ulysses, after attention: ``concat_over_ranks(A, dim=-1) @ B`` on my sequence slice.

    ``A`` is the full sequence (``seq_dim``) of this rank's column block ``[.., k]``; ``B`` is
    ``[W*k, n]``. Returns this rank's sequence slice ``[.., n]``: ``sizes[rank]`` rows, ``sizes``
    defaulting to `commfuse.even_sizes`. ``check``: checked mode (see the module docstring).
    """
    checks.check_tensor("A", A)
    checks.check_tensor("B", B, 2)
    dim = checks.check_dim("seq_dim", seq_dim, "A", A)
    spec = method_spec(method, opts)
    group = checks.resolve_group(group)
    w = group.size()
    if B.dim() != 2 or B.shape[0] != w * A.shape[-1]:
        raise ValueError(f"B must be [group size * A.shape[-1], n] = [{w * A.shape[-1]}, n], "
                         f"got shape {tuple(B.shape)}")
    if B.dtype != A.dtype:
        raise TypeError(f"B has dtype {B.dtype} but A has {A.dtype}")
    if B.device != A.device:
        raise ValueError(f"B is on {B.device} but A is on {A.device}")
    if checks.checked(check):
        checks.agree_shapes("a2a_matmul", group, A, dim, sizes, whole=True,
                            timeout=spec.timeout)
    sizes = checks.check_sizes(sizes, w, group.rank(), total=A.shape[dim])
    spec = auto.resolve(spec, "a2a_matmul", (A.numel() // max(A.shape[-1], 1), *B.shape), w, A,
                        group)
    if torch.compiler.is_compiling():
        return library.all_to_all_matmul(A, B, dim, sizes, group, spec)
    return AllToAllMatmul.apply(A, B, dim, sizes, group, spec)


def _prefetcher(value) -> None:
    if value is not None and not isinstance(value, Prefetcher):
        raise TypeError(f"prefetch must be a commfuse.ops.prefetch.Prefetcher or None, "
                        f"got {value!r}")


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value

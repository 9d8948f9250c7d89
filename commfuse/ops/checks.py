"""Input checks every fused op runs before any communication.

Bad input raises on the calling rank with a message naming the argument, instead of leaving
its peers waiting.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from commfuse.ops.binding import even_sizes


def resolve_group(group) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("commfuse ops need torch.distributed initialised "
                           "(torch.distributed.init_process_group)")
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(group).__name__}")
    return group


def check_tensor(name: str, t, min_dim: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(t.shape)}")
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_matmul(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """``a[..., k] @ b[k, n]``: same dtype and device, 2-D ``b``, matching k."""
    check_tensor(b_name, b, 2)
    if b.dim() != 2:
        raise ValueError(f"{b_name} must be 2-D [k, n], got shape {tuple(b.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"{b_name} has dtype {b.dtype} but {a_name} has {a.dtype}")
    if b.device != a.device:
        raise ValueError(f"{b_name} is on {b.device} but {a_name} is on {a.device}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"shapes do not multiply: {a_name} {tuple(a.shape)} @ "
                         f"{b_name} {tuple(b.shape)}")


def check_dim(name: str, dim, a_name: str, a: torch.Tensor) -> int:
    """A dim of ``a`` other than the last (which is the GEMM's contraction), normalised."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    if not -a.dim() <= dim < a.dim():
        raise ValueError(f"{name}={dim} is out of range for {a_name} with {a.dim()} dims")
    dim %= a.dim()
    if dim == a.dim() - 1:
        raise ValueError(f"{name} cannot be the last dim of {a_name} (the GEMM contracts it)")
    return dim


def other_rows(t: torch.Tensor, dim: int) -> int:
    """The product of ``t``'s dims other than ``dim`` and the last (GEMM rows per row of dim)."""
    return math.prod([t.shape[i] for i in range(t.dim() - 1) if i != dim])  # a list: Dynamo


def check_divisible(what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{what} ({size}) must be divisible by the group size ({world})")


def check_sizes(sizes, world: int, rank: int, *, local: int | None = None,
                total: int | None = None, what: str = "sizes") -> tuple[int, ...]:
    """``sizes`` (rows of each rank's slice) validated against this rank's slice ``local``
    and the full dim ``total``, or the default: ``local`` on every rank, else `even_sizes`."""
    if sizes is None:
        return (local,) * world if local is not None else even_sizes(total, world)
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__"):
        raise TypeError(f"{what} must be a list or tuple of ints (rows per rank), got {sizes!r}")
    sizes = tuple(sizes)
    if len(sizes) != world:
        raise ValueError(f"{what} must have one entry per rank of the group ({world}), "
                         f"got {len(sizes)}: {sizes}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in sizes):
        raise ValueError(f"{what} must be non-negative ints, got {sizes}")
    if local is not None and sizes[rank] != local:
        raise ValueError(f"{what}[{rank}] = {sizes[rank]} but this rank's slice has {local} rows")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"{what} sum to {sum(sizes)} but the dim has {total} rows: {sizes}")
    return sizes


MAX_DIMS = 16  # checked mode: the longest shape one exchange carries


def checked(check) -> bool:
    """Whether an op runs in checked mode: ``check`` if given, else ``COMMFUSE_CHECK=1``."""
    if check is None:
        return os.environ.get("COMMFUSE_CHECK", "0") not in ("", "0")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool or None, got {check!r}")
    return check


def agree_shapes(op: str, group, a: torch.Tensor, dim: int, sizes, *, whole: bool,
                 b_cols: int | None = None, timeout: float | None = None) -> None:
    """Checked mode: one all_gather of every rank's A shape, ``sizes`` and B's columns, then
    the same verdict on every rank: `ShapeMismatchError` naming the op and the ranks whose
    shapes do not fit together. ``whole``: A holds the whole dim (GEMM->RS, a2a->GEMM), else
    this rank's slice of it (``sizes`` default: every slice as long as this rank's).
    ``timeout``: the op's deadline for the exchange (None: the group's); a peer that failed
    makes it a `CommFuseError`."""
    from commfuse.errors import CommFuseError, ShapeMismatchError
    from commfuse.runtime.collectives import exchange

    w = group.size()
    if a.dim() > MAX_DIMS:
        raise ValueError(f"checked mode supports at most {MAX_DIMS} dims, got {a.dim()}")
    given = list(sizes) if sizes is not None else [-1] * w
    if len(given) != w:
        given = [-2] * w  # the local check names this one
    row = [a.dim(), dim, -1 if b_cols is None else b_cols, *a.shape, *[-1] * (MAX_DIMS - a.dim()),
           *given]
    mine = torch.tensor(row, dtype=torch.int64, device=a.device)
    try:  # with the op's deadline: a peer that died before the op must not block this one
        every = exchange(mine, group, timeout)
    except Exception as e:
        raise CommFuseError(f"commfuse {op} (checked mode, rank {group.rank()} of {w}) failed "
                            f"exchanging the shapes: {type(e).__name__}: {e}", op=op,
                            rank=group.rank()) from e
    rows = [t.cpu().tolist() for t in every]
    shapes = [tuple(r[3:3 + r[0]]) for r in rows]
    problems = []
    rest = [tuple(n for i, n in enumerate(s) if i != r[1]) for s, r in zip(shapes, rows)]
    if len(set(rest)) > 1:
        problems.append(f"A's dims other than the {'scattered' if whole else 'gathered'} one "
                        f"differ: {_by_rank(shapes)}")
    if len({r[2] for r in rows}) > 1:
        problems.append(f"B's columns differ: {_by_rank([r[2] for r in rows])}")
    lengths = [s[r[1]] if r[1] < len(s) else -1 for s, r in zip(shapes, rows)]
    lists = [tuple(r[3 + MAX_DIMS:]) for r in rows]
    if whole:
        if len(set(lengths)) > 1:
            problems.append(f"the whole dim must have the same length on every rank: "
                            f"{_by_rank(lengths)}")
        effective = [x if x[0] != -1 else even_sizes(n, w) for x, n in zip(lists, lengths)]
        if len(set(effective)) > 1:
            problems.append(f"sizes differ: {_by_rank(effective)}")
    else:
        effective = [x if x[0] != -1 else (n,) * w for x, n in zip(lists, lengths)]
        if len(set(effective)) > 1:
            problems.append(f"the slices do not agree with the sizes each rank assumes "
                            f"(pass sizes=[...], the same list on every rank): rows "
                            f"{_by_rank(lengths)}, sizes {_by_rank(effective)}")
        elif any(n != effective[0][p] for p, n in enumerate(lengths)):
            problems.append(f"slice rows {_by_rank(lengths)} do not match sizes "
                            f"{list(effective[0])}")
    if problems:
        raise ShapeMismatchError(f"commfuse {op} (checked mode, rank {group.rank()} of {w}): "
                                 + "; ".join(problems))


def _by_rank(values) -> str:
    return ", ".join(f"rank {p}: {tuple(v) if isinstance(v, (tuple, list)) else v}"
                     for p, v in enumerate(values))

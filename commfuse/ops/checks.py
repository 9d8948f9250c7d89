"""Input checks every fused op runs before any communication.

Bad input raises on the calling rank with a message naming the argument, instead of leaving
its peers waiting.
"""

from __future__ import annotations

import math

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

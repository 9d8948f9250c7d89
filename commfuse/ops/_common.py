"""What every fused op shares: group and method resolution, input checks, running a schedule.

Every check here runs before any communication, so bad input raises on the calling rank
with a message naming the argument instead of leaving peers waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commfuse import collectives, executor, schedule

DEFAULT_CHUNKS = 4
OPTIONS = {  # the options each method accepts
    "auto": {"timeout"},  # commfuse.auto picks a method and its options per shape
    "none": {"timeout", "collective"},
    "sliced": {"timeout", "chunks", "collective"},
    "decompose": {"timeout", "topology", "splits"},
    "commfuse": {"timeout", "topology", "splits"},
}


@dataclass(frozen=True)
class MethodSpec:
    """A validated method and its options."""

    method: str
    topology: str = "ring"  # commfuse/decompose: "ring" (the paper) or "direct"
    chunks: int = DEFAULT_CHUNKS  # sliced: number of chunks along the gathered/scattered dim
    timeout: float | None = None  # seconds to wait for a transfer; None: the group's timeout
    collective: str = "auto"  # none/sliced: "backend", "p2p" or "auto" (commfuse.collectives)
    splits: int = 1  # decompose/commfuse: sub-slices per rank's slice (m in DESIGN.md)


def method_spec(method: str, opts: dict) -> MethodSpec:
    if not isinstance(method, str) or method not in OPTIONS:
        raise ValueError(f"method must be one of {sorted(OPTIONS)}, got {method!r}")
    unknown = set(opts) - OPTIONS[method]
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for method={method!r}; "
                         f"it accepts {sorted(OPTIONS[method])}")
    topology = opts.get("topology", "ring")
    if topology not in schedule.TOPOLOGIES:
        raise ValueError(f"topology must be one of {schedule.TOPOLOGIES}, got {topology!r}")
    chunks = opts.get("chunks", DEFAULT_CHUNKS)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    timeout = opts.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    splits = opts.get("splits", 1)
    if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits!r}")
    collective = opts.get("collective", "auto")
    if collective not in collectives.POLICIES:
        raise ValueError(f"collective must be one of {collectives.POLICIES}, got {collective!r}")
    return MethodSpec(method, topology, chunks, timeout, collective, splits)


def resolve_auto(spec: MethodSpec, op: str, shape, world: int, like) -> MethodSpec:
    """``spec`` itself, or for method "auto" the method `commfuse.auto` chooses for the shape."""
    if spec.method != "auto":
        return spec
    from commfuse import auto

    method, opts = auto.choose(op, tuple(int(x) for x in shape), world, like)
    return method_spec(method, {**opts, "timeout": spec.timeout} if spec.timeout else opts)


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
    return math.prod(t.shape[i] for i in range(t.dim() - 1) if i != dim)


def check_divisible(what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{what} ({size}) must be divisible by the group size ({world})")


def even_sizes(total: int, world: int) -> tuple[int, ...]:
    """Rows per rank of ``total`` rows over ``world`` ranks, as even as possible, the first
    ranks one longer (10 over 4: 3, 3, 2, 2): the split every op assumes by default."""
    return tuple(n for _, n in split(total, world))


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


class Binding:
    """What the bindings of the four ops share: which rows each slot or chunk is.

    Rank p's slice of the gathered/scattered dim has ``sizes[p]`` rows at ``offs[p]`` (slices
    may differ by any amount; `even_sizes` is the default). P2P methods cut each slice into
    ``m`` sub-slices (slot p*m + j is sub-slice j of slice p); ``none``/``sliced`` cut each into
    the same number of chunks (chunk j of every slice moves in one collective). Subclasses set
    ``world`` and ``rank``, call `cut`, and implement what their op's schedules use.
    """

    world: int
    rank: int
    sizes: tuple[int, ...]  # rows of each rank's slice
    offs: tuple[int, ...]  # where each rank's slice starts in the full dim
    s: int  # rows of this rank's slice
    total: int  # rows of the full dim
    even: bool  # every slice has s rows (chunks are strided views, no gathering copies)
    pieces: list[list[tuple[int, int]]] | None = None  # sliced / none: [rank][chunk] (off, rows)
    m: int = 1  # P2P methods: sub-slices per slice
    subs: list[list[tuple[int, int]]] = [[(0, 0)]]  # P2P methods: [rank][j] (off, rows)

    def cut(self, sizes: tuple[int, ...], spec: MethodSpec) -> None:
        """Cut every rank's slice into the chunks or sub-slices ``spec`` asks for (the same
        count for every slice, never more than the shortest has rows)."""
        self.sizes, self.s, self.total = sizes, sizes[self.rank], sum(sizes)
        self.offs = tuple(off for off, _ in _runs(sizes))
        self.even = len(set(sizes)) == 1
        shortest = max(min(sizes), 1)
        if spec.method in ("none", "sliced"):
            k = 1 if spec.method == "none" else min(spec.chunks, shortest)
            self.pieces = [split(n, k) for n in sizes]
        else:
            self.m = min(spec.splits, shortest)
            self.subs = [split(n, self.m) for n in sizes]

    def chunks(self, spec: MethodSpec) -> int:
        return len(self.pieces[0]) if self.pieces else self.world

    @property
    def whole(self) -> bool:
        """``none``: one chunk, the whole slice of every rank (collectives can use the result)."""
        return bool(self.pieces) and len(self.pieces[0]) == 1

    def sub_rows(self, slot: int, rank: int | None = None) -> slice:
        """Rows of sub-slice ``slot % m`` within the slice of ``rank`` (default: the slot's
        owner ``slot // m``)."""
        off, n = self.subs[slot // self.m if rank is None else rank][slot % self.m]
        return slice(off, off + n)

    def rows(self, slot: int) -> slice:
        """Rows of ``slot`` in the full, gathered or scattered, dim."""
        base, r = self.offs[slot // self.m], self.sub_rows(slot)
        return slice(base + r.start, base + r.stop)

    # sliced / none: chunk j is rows pieces[p][j] of every rank p's slice
    def piece(self, j: int) -> tuple[int, int]:
        """(offset in this rank's slice, rows) of chunk ``j``."""
        return self.pieces[self.rank][j]

    def chunk_sizes(self, j: int) -> list[int]:
        return [self.pieces[p][j][1] for p in range(self.world)]

    def chunk_rows(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Chunk ``j`` of every slice of ``x``'s full dim 0: a strided ``[W, n, ...]`` view when
        the slices are even, else their rows concatenated in rank order ``[sum n_p, ...]``."""
        if self.whole:
            return x.unflatten(0, (self.world, self.s)) if self.even else x
        if self.even:
            off, n = self.piece(j)
            return x.unflatten(0, (self.world, self.s))[:, off:off + n]
        return torch.cat([x[self.offs[p] + off:self.offs[p] + off + n]
                          for p, (off, n) in enumerate(row[j] for row in self.pieces)])

    def flat(self, chunk: torch.Tensor) -> torch.Tensor:
        """A `chunk_rows`-shaped result as ``[sum n_p, ...]``."""
        return chunk.flatten(0, 1) if self.even else chunk

    def place(self, dst: torch.Tensor, j: int, src: torch.Tensor) -> None:
        """Copy ``src`` (chunk ``j``'s rows of every slice, in rank order) into full ``dst``."""
        for p, part in enumerate(src.split(self.chunk_sizes(j))):
            off, n = self.pieces[p][j]
            dst[self.offs[p] + off:self.offs[p] + off + n].copy_(part)

    def reduce(self, slot: int, peers: tuple[int, ...]) -> None:
        raise AssertionError(f"{type(self).__name__}: this op's schedules have no reduction")

    def collective_done(self, slot: int) -> None:
        pass


def execute(op: str, spec: MethodSpec, group: dist.ProcessGroup, binding,
            device: torch.device) -> None:
    """Build this rank's schedule for ``op`` and run it with ``binding``'s tensors."""
    world, rank = group.size(), group.rank()
    sched = schedule.build(op, spec.method, world, rank, topology=spec.topology,
                           chunks=binding.chunks(spec), splits=binding.m)
    executor.run(sched, binding,
                 executor.make_transport(group, device, spec.timeout, spec.collective))


def split(size: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of ``parts`` near-equal pieces of ``size`` (the first ones longer)."""
    base, extra = divmod(size, parts)
    return _runs([base + (i < extra) for i in range(parts)])


def _runs(lengths) -> list[tuple[int, int]]:
    """(offset, length) of consecutive runs of ``lengths``."""
    out, off = [], 0
    for n in lengths:
        out.append((off, n))
        off += n
    return out

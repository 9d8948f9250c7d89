"""What every fused op shares: group and method resolution, input checks, running a schedule.

Every check here runs before any communication, so bad input raises on the calling rank
with a message naming the argument instead of leaving peers waiting.
"""

from __future__ import annotations

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


def check_divisible(what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{what} ({size}) must be divisible by the group size ({world})")


class Binding:
    """What the bindings of the four ops share: slots for P2P methods, chunks for the others.

    Subclasses set ``world``, ``rank`` and ``pieces`` (None under P2P methods, else the
    (offset, rows) of each chunk of a slice) and implement what their op's schedules use.
    """

    world: int
    rank: int
    s: int  # rows of one rank's slice
    pieces: list[tuple[int, int]] | None = None  # sliced / none: (offset, rows) of each chunk
    m: int = 1  # P2P methods: sub-slices per slice; slot p*m + j is sub-slice j of slice p
    sub: list[tuple[int, int]] = [(0, 0)]  # P2P methods: (offset, rows) of each sub-slice

    def cut(self, s: int, spec: MethodSpec) -> None:
        """Cut a slice of ``s`` rows into the chunks or sub-slices ``spec`` asks for."""
        self.s = s
        if spec.method in ("none", "sliced"):
            self.pieces = chunk_pieces(s, spec)
        else:
            self.m = min(spec.splits, max(s, 1))
            self.sub = split(s, self.m)

    def chunks(self, spec: MethodSpec) -> int:
        return len(self.pieces) if self.pieces else self.world

    def sub_rows(self, slot: int) -> slice:
        """Rows of ``slot``'s sub-slice within its rank's slice."""
        off, n = self.sub[slot % self.m]
        return slice(off, off + n)

    def rows(self, slot: int) -> slice:
        """Rows of ``slot`` in the full, gathered or scattered, dim."""
        base = slot // self.m * self.s
        r = self.sub_rows(slot)
        return slice(base + r.start, base + r.stop)

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


def chunk_pieces(size: int, spec: MethodSpec) -> list[tuple[int, int]]:
    """The chunks of a slice of ``size`` rows under ``none`` (one) or ``sliced`` (at most
    ``spec.chunks``, never more than there are rows)."""
    return split(size, 1 if spec.method == "none" else min(spec.chunks, max(size, 1)))


def split(size: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of ``parts`` near-equal pieces of ``size`` (the first ones longer)."""
    base, extra = divmod(size, parts)
    out, off = [], 0
    for i in range(parts):
        n = base + (i < extra)
        out.append((off, n))
        off += n
    return out

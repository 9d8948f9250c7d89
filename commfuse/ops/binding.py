"""What the bindings of the four ops share: which rows each slot or chunk is, and running a
schedule with one (`execute`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from commfuse import schedule
from commfuse.ops.methods import MethodSpec
from commfuse.runtime import executor, modes

even_sizes = schedule.even_sizes  # the ops' default split (commfuse.even_sizes)


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
            self.m = min(spec.splits or 1, shortest)  # None: unresolved, the paper's m=1
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


def build(op: str, spec: MethodSpec, group: dist.ProcessGroup, binding) -> schedule.Schedule:
    """This rank's schedule for ``op`` under ``spec``, cut as ``binding`` is."""
    return schedule.build(op, spec.method, group.size(), group.rank(), topology=spec.topology,
                          chunks=binding.chunks(spec), splits=binding.m)


def execute(op: str, spec: MethodSpec, group: dist.ProcessGroup, binding,
            device: torch.device, after_posts=None) -> None:
    """Build this rank's schedule for ``op`` and run it with ``binding``'s tensors;
    ``after_posts()`` runs right after its last post (`commfuse.runtime.executor.run`). A
    tracer (`commfuse.runtime.modes.mode`) gets the whole call as an "op" span."""
    t0 = time.perf_counter()
    executor.run(build(op, spec, group, binding), binding,
                 executor.make_transport(group, device, spec.timeout, spec.collective),
                 after_posts)
    if (tracer := modes.tracer()) is not None:
        tracer.add("op", f"{op} {spec.method}", t0, time.perf_counter())


def split(size: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of ``parts`` near-equal pieces of ``size`` (the first ones longer)."""
    return _runs(even_sizes(size, parts))


def _runs(lengths) -> list[tuple[int, int]]:
    """(offset, length) of consecutive runs of ``lengths``."""
    out, off = [], 0
    for n in lengths:
        out.append((off, n))
        off += n
    return out

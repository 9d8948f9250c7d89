"""`ExpertCounts`: one step's expert-parallel routing table, the same on every rank, and
what the MoE schedules (`commfuse.schedule.moe`, whose docstring describes the layouts and
the dedup) read from it: rows per (source, destination), offsets, pieces."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from commfuse.schedule import even_sizes


@dataclass(frozen=True)
class ExpertCounts:
    """Rows each rank routes to each expert, the same table on every rank of the EP group.

    ``tokens[p][e]``: rows rank p sends to global expert e (W rows of E non-negative ints,
    E divisible by W). Everything else is derived from it, identically on every rank.
    """

    tokens: tuple[tuple[int, ...], ...]
    firsts: tuple[tuple[int, ...], ...] | None = None
    lasts: tuple[tuple[int, ...], ...] | None = None
    singles: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        self._check(self.tokens)
        extra = (self.firsts, self.lasts, self.singles)
        if any(t is None for t in extra) != all(t is None for t in extra):
            raise ValueError("firsts, lasts and singles come together (the deduplicated "
                             "dispatch) or not at all")
        if self.firsts is None:
            return
        for t in extra:
            self._check(t)
            if len(t) != self.world or len(t[0]) != self.experts:
                raise ValueError("firsts, lasts and singles must have the shape of tokens")
        for p in range(self.world):
            for e in range(self.experts):
                n, f, la, s = (t[p][e] for t in (self.tokens, *extra))
                if s > min(f, la) or f + la - s > n:
                    raise ValueError(f"rank {p}, expert {e}: {n} rows cannot hold {f} firsts, "
                                     f"{la} lasts and {s} singles")
            for q in range(self.world):
                cut = slice(q * self.local, (q + 1) * self.local)
                if sum(self.firsts[p][cut]) != sum(self.lasts[p][cut]):
                    raise ValueError(f"rank {p} -> {q}: the firsts and the lasts count "
                                     f"different tokens")

    @staticmethod
    def _check(table):
        if not isinstance(table, tuple) or not table or not all(
                isinstance(row, tuple) for row in table):
            raise ValueError(f"tokens must be a non-empty tuple of tuples (ranks x experts), "
                             f"got {table!r}")
        lengths = {len(row) for row in table}
        if len(lengths) != 1 or not lengths.pop():
            raise ValueError(f"every rank's row of tokens must list the same number (> 0) of "
                             f"experts, got lengths {[len(row) for row in table]}")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0
               for row in table for n in row):
            raise ValueError(f"tokens must be non-negative ints, got {table}")
        if len(table[0]) % len(table):
            raise ValueError(f"the number of experts ({len(table[0])}) must be divisible by "
                             f"the group size ({len(table)})")

    @property
    def world(self) -> int:
        return len(self.tokens)

    @property
    def dedup(self) -> bool:
        """Whether the dispatch moves one row per (token, destination rank) (module doc)."""
        return self.firsts is not None

    @cached_property
    def pairs(self) -> tuple[tuple[int, ...], ...]:
        """``pairs[p][q]``: the rows the dispatch moves from p to q and the combine from q
        back to p: rank p's distinct tokens routed to rank q (``rows`` without dedup)."""
        if not self.dedup:
            return self.rows
        return tuple(tuple(sum(self.firsts[p][q * self.local:(q + 1) * self.local])
                           for q in range(self.world)) for p in range(self.world))

    def dispatched(self, p: int) -> int:
        """Rows of rank p's dispatch input and combine output (its unique rows)."""
        return sum(self.pairs[p])

    def span(self, op: str, p: int, e: int) -> tuple[int, int]:
        """(start, rows) inside group (p, global expert e) of the rows whose token ``op``
        moves there: the dispatch's firsts, the combine's lasts (module doc)."""
        n, f, la, s = (t[p][e] for t in (self.tokens, self.firsts, self.lasts, self.singles))
        middle = n - f - la + s
        return (middle, f) if op == "moe_dispatch" else (middle + f - s, la)

    def moved_piece(self, op: str, p: int, q: int, k: int, j: int) -> tuple[int, int]:
        """(offset, rows) in slot (p -> q)'s moved rows (`pairs`, ``op``'s order) of what
        ``op`` moves for chunk j of k of the slot's expanded rows (`piece` of ``rows``)."""
        lo, n = piece(self.rows[p][q], k, j)
        if not self.dedup:
            return lo, n
        a = self._moved_before(op, p, q, lo)
        return a, self._moved_before(op, p, q, lo + n) - a

    def _moved_before(self, op: str, p: int, q: int, end: int) -> int:
        total, at = 0, 0
        for e in range(q * self.local, (q + 1) * self.local):
            start, n = self.span(op, p, e)
            total += max(0, min(end, at + start + n) - (at + start))
            at += self.tokens[p][e]
        return total

    @property
    def experts(self) -> int:
        return len(self.tokens[0])

    @property
    def local(self) -> int:
        """E_l: experts per rank."""
        return self.experts // self.world

    def groups(self, p: int, q: int) -> tuple[int, ...]:
        """Rows rank p sends to each of rank q's local experts: slot (p -> q)'s groups."""
        return self.tokens[p][q * self.local:(q + 1) * self.local]

    @cached_property
    def rows(self) -> tuple[tuple[int, ...], ...]:
        """``rows[p][q]``: rows rank p dispatches to rank q (and q combines back to p)."""
        return tuple(tuple(sum(self.groups(p, q)) for q in range(self.world))
                     for p in range(self.world))

    def sent(self, p: int) -> int:
        """Rows of rank p's send layout (its dispatch input, its combine output)."""
        return sum(self.tokens[p])

    def received(self, q: int) -> int:
        """Rows of rank q's receive layout (its dispatch output, its combine input)."""
        return sum(self.rows[p][q] for p in range(self.world))

    def send_offsets(self, p: int) -> tuple[int, ...]:
        """Where slot q starts in rank p's send layout, for each q."""
        return starts(self.rows[p])

    def recv_offsets(self, q: int) -> tuple[int, ...]:
        """Where slot p starts in rank q's receive layout, for each p."""
        return starts([row[q] for row in self.rows])

    def expert_runs(self, q: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """For each of rank q's local experts, its (start, rows) runs in q's receive layout,
        one per source slot (in source order; empty runs included)."""
        offs = self.recv_offsets(q)
        runs = []
        for e in range(self.local):
            runs.append(tuple((offs[p] + sum(self.groups(p, q)[:e]), self.groups(p, q)[e])
                              for p in range(self.world)))
        return tuple(runs)

    def expert_rows(self, q: int) -> tuple[int, ...]:
        """Rows each of rank q's local experts receives, over all sources."""
        return tuple(sum(self.groups(p, q)[e] for p in range(self.world))
                     for e in range(self.local))


def piece(n: int, k: int, j: int) -> tuple[int, int]:
    """(offset, rows) of chunk j of a slot of n rows cut into k near-equal chunks."""
    sizes = even_sizes(n, k)
    return sum(sizes[:j]), sizes[j]


def starts(lengths) -> tuple[int, ...]:
    """Where each of ``lengths`` begins when they are laid end to end."""
    out, off = [], 0
    for n in lengths:
        out.append(off)
        off += n
    return tuple(out)

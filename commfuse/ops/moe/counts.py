"""The per-step expert counts of expert parallelism: exchanged once per step and validated,
with the same verdict on every rank, before any token moves.

The MoE ops size every message from `commfuse.schedule.moe.ExpertCounts`, so a table that
differs between ranks, or that does not match a rank's rows, would post a send and a receive
of different sizes (gloo aborts the receiving process). Both functions here first all-gather
a fixed-size header (the table's shape, the rows it must describe, this rank's own verdict),
so even ranks that disagree on the number of experts exchange messages of one size; only
when every header agrees do they gather the counts themselves. Any problem raises
`CountsError` on every rank, naming the ranks and what each has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commfuse.errors import CommFuseError
from commfuse.runtime import deadlines
from commfuse.schedule.moe import ExpertCounts

_LOCAL = {1: "counts that are not a 1-D list of ints", 2: "negative counts",
          3: "rows that are not a non-negative int"}


class CountsError(CommFuseError, ValueError):
    """The ranks' expert counts do not fit together or do not match their tensors' rows.
    Raised on every rank of the group, before any payload is sent."""


def exchange_counts(hist, group: dist.ProcessGroup, *, rows: int,
                    timeout: float | None = None, device=None) -> ExpertCounts:
    """Every rank's router histogram, gathered into the `ExpertCounts` table every rank holds.

    ``hist``: the rows this rank routes to each of the E experts (a 1-D integer tensor, as
    ``torch.bincount(experts, minlength=E)`` gives, or a list of ints); ``rows``: the rows of
    the tensor it will dispatch (``hist`` must sum to it). Two small all-gathers (a header of
    3 ints, then E ints). Raises `CountsError` on every rank if any rank's histogram is
    malformed, does not sum to its rows, or lists another number of experts, or if E is not
    divisible by the group size; a collective that fails or outlives ``timeout`` seconds
    (None: the group's timeout) raises `CommFuseError`. ``device``: where the exchanged
    integers live (the group's backend must reach it: CPU for gloo, the GPU for NCCL; default
    ``hist``'s device if it is a tensor, else the CPU).
    """
    if device is None:
        device = hist.device if isinstance(hist, torch.Tensor) else torch.device("cpu")
    values, code = _as_ints(hist)
    if not code and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
        code, rows = 3, -1
    w, me = group.size(), group.rank()
    header = [len(values) if values is not None else -1, rows, code]
    every = _gather("exchange_counts", header, group, timeout, device)
    problems = [f"rank {p}: {_LOCAL[c]}" for p, (_, _, c) in enumerate(every) if c]
    lengths = [n for n, _, _ in every]
    if not problems and len(set(lengths)) > 1:
        problems.append(f"the ranks count different numbers of experts: {_by_rank(lengths)}")
    if not problems and not lengths[0]:
        problems.append("the histograms list no experts")
    if not problems and lengths[0] % w:
        problems.append(f"{lengths[0]} experts are not divisible by the group size {w}")
    _verdict("exchange_counts", problems, me, w)
    table = _gather("exchange_counts", values, group, timeout, device)
    bad = [p for p, (row, (_, n, _)) in enumerate(zip(table, every)) if sum(row) != n]
    _verdict("exchange_counts", [
        f"rank {p}'s counts sum to {sum(table[p])} but its tensor has {every[p][1]} rows"
        for p in bad], me, w)
    return ExpertCounts(tuple(tuple(row) for row in table))


def agree_counts(op: str, counts: ExpertCounts, rows: int, group: dist.ProcessGroup,
                 timeout: float | None = None, device=torch.device("cpu")) -> None:
    """Checked mode of the MoE ops: every rank holds the same ``counts`` for this group and
    its tensor has the rows the table gives it (``rows``: this rank's, in the op's layout:
    ``counts.dispatched(rank)`` for the dispatch, ``counts.received(rank)`` for the
    combine).
    Two small all-gathers; `CountsError` on every rank otherwise."""
    w, me = group.size(), group.rank()
    tables = (counts.tokens, counts.firsts, counts.lasts, counts.singles) if counts.dedup \
        else (counts.tokens,)
    flat = [n for table in tables for row in table for n in row]
    header = [counts.world, counts.experts, rows, len(tables)]
    every = _gather(op, header, group, timeout, device)
    problems = []
    shapes = [(a, b, d) for a, b, _, d in every]
    if len(set(shapes)) > 1:
        problems.append(f"the counts tables' shapes (ranks x experts x tables) differ: "
                        f"{_by_rank(shapes)}")
    elif shapes[0][0] != w:
        problems.append(f"the counts table has {shapes[0][0]} rows, the group {w} ranks")
    _verdict(op, problems, me, w)
    tables = _gather(op, flat, group, timeout, device)
    differ = [p for p in range(w) if tables[p] != tables[0]]
    if differ:
        problems.append(f"the counts tables differ between ranks: rank 0 has {tables[0]}, "
                        + ", ".join(f"rank {p} has {tables[p]}" for p in differ))
    else:
        e = shapes[0][1]
        table = ExpertCounts(*(tuple(tuple(tables[0][(i * w + p) * e:(i * w + p + 1) * e])
                                     for p in range(w)) for i in range(shapes[0][2])))
        want = [table.dispatched(p) if op == "moe_dispatch" else table.received(p)
                for p in range(w)]
        got = [r for _, _, r, _ in every]
        wrong = [p for p in range(w) if got[p] != want[p]]
        if wrong:
            problems.append("rows do not match the counts: " + ", ".join(
                f"rank {p} has {got[p]}, the table gives it {want[p]}" for p in wrong))
    _verdict(op, problems, me, w)


def _as_ints(hist) -> tuple[list[int] | None, int]:
    """(the values, 0) or (None, a `_LOCAL` code) for a histogram this rank was given."""
    if isinstance(hist, torch.Tensor):
        if hist.dim() != 1 or hist.is_floating_point() or hist.is_complex() or hist.dtype == torch.bool:
            return None, 1
        values = hist.tolist()
    elif isinstance(hist, (list, tuple)):
        if any(not isinstance(n, int) or isinstance(n, bool) for n in hist):
            return None, 1
        values = list(hist)
    else:
        return None, 1
    if any(n < 0 for n in values):
        return None, 2
    return values, 0


def _gather(op: str, values: list[int], group, timeout, device) -> list[list[int]]:
    """Every rank's ``values`` (as many on each), by rank: one all-gather, waited within
    ``timeout`` seconds (None: the group's own timeout, which bounds gloo's collectives)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(group.size())]
    try:
        work = dist.all_gather(every, mine, group=group, async_op=True)
        deadlines.wait(work, group, mine.device, timeout)  # CUDA: the .tolist() below syncs
    except CommFuseError:
        raise
    except Exception as e:
        raise CommFuseError(f"commfuse {op} (rank {group.rank()} of {group.size()}) failed "
                            f"exchanging the expert counts: {type(e).__name__}: {e}") from e
    return torch.stack(every).tolist()  # one transfer to the host


def _verdict(op: str, problems: list[str], rank: int, w: int) -> None:
    if problems:
        raise CountsError(f"commfuse {op} (rank {rank} of {w}): " + "; ".join(problems))


def _by_rank(values) -> str:
    return ", ".join(f"rank {p}: {v}" for p, v in enumerate(values))

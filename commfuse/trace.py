"""Timelines: spans of compute and communication, as a Chrome/Perfetto trace or a PNG Gantt chart.

One `Span` type for a measured run (recorded by the executor into a `Tracer`, gathered by the
benchmarks) and a predicted one (the simulator). No torch needed; the PNG needs matplotlib
(``commfuse[bench]``), imported when a chart is drawn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Span kinds (a track's first word) in the order their rows and threads are shown, and colours.
COLORS = {"step": "#333333", "op": "#2a9d8f", "compute": "#4c72b0", "reduce": "#64b5cd",
          "host": "#937860", "wait": "#8c8c8c", "send": "#dd8452", "recv": "#55a868",
          "collective": "#c44e52", "tp": "#8172b3", "up": "#8172b3", "dp": "#da8bc3",
          "world": "#c44e52", "exposed": "#c44e52"}
_ORDER = tuple(COLORS)


@dataclass(frozen=True)
class Span:
    """One interval (seconds) of a rank's timeline, on a track named by its kind first: step,
    op (one fused op's whole call), compute, reduce, host, wait, send, recv, collective; a
    measured run names the peer ("send to 1"), a whole-model step uses the group's lane (tp,
    up, dp, world) and "exposed"."""

    rank: int
    track: str
    label: str
    start: float
    end: float

    @property
    def kind(self) -> str:
        """The track's first word: "send to 1" is a send."""
        return self.track.split()[0]


class Tracer:
    """Collects the spans of rank ``rank`` (this process) as the executor runs: give it to
    `commfuse.runtime.modes.mode`."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.spans: list[Span] = []

    def add(self, track: str, label: str, start: float, end: float) -> None:
        self.spans.append(Span(self.rank, track, label, start, end))


def _order(kind: str) -> int:
    return _ORDER.index(kind) if kind in _ORDER else len(_ORDER)


def trace_events(spans: Sequence[Span]) -> list[dict]:
    """The trace events of ``spans``: ranks are processes, tracks are threads, times in
    microseconds from the first span's start."""
    events: list[dict] = []
    t0 = min((s.start for s in spans), default=0.0)
    by_rank: dict[int, list[Span]] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    for rank in sorted(by_rank):
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        tracks = sorted({s.track for s in by_rank[rank]}, key=lambda t: (_order(t.split()[0]), t))
        for tid, track in enumerate(tracks):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": track}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in by_rank[rank]:
            events.append({"ph": "X", "pid": rank, "tid": tracks.index(s.track), "name": s.label,
                           "ts": 1e6 * (s.start - t0), "dur": 1e6 * (s.end - s.start)})
    return events


def write_trace(spans: Sequence[Span], path: str) -> None:
    """Write ``spans`` as a Chrome trace JSON (open in ui.perfetto.dev or chrome://tracing),
    creating ``path``'s folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(spans), "displayTimeUnit": "ms"}, f)


class Panel(NamedTuple):
    """One chart of a Gantt figure: ``spans`` drawn from ``origin`` (default: the first span's
    start), with a vertical line at each time in ``ends`` (e.g. where each rank's step ended)."""

    title: str
    spans: Sequence[Span]
    ends: Sequence[float] = ()
    origin: float | None = None


def write_gantt(panels, path: str, title: str = "", max_ranks: int | None = 8) -> None:
    """Write ``panels`` (`Panel`s, or (title, spans) pairs) as a PNG Gantt chart at ``path``:
    one chart per panel, in it one row per (rank, kind), so compute, transfers, waits and
    exposed communication show side by side; at most ``max_ranks`` ranks (the first ones,
    None: all). Raises ImportError without matplotlib (``pip install 'commfuse[bench]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [Panel(*p) for p in panels]
    rows_per = [_rows(p.spans, max_ranks) for p in panels]
    heights = [max(len(r), 1) * 0.28 + 0.5 for r in rows_per]
    height = sum(heights) + 0.6
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, height), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, p, rows in zip(axes[:, 0], panels, rows_per):
        t0 = min((s.start for s in p.spans), default=0.0) if p.origin is None else p.origin
        last = max([s.end for s in p.spans] + list(p.ends), default=t0)
        scale, unit = _unit(last - t0)
        for y, (rank, kind) in enumerate(rows):
            bars = [((s.start - t0) * scale, (s.end - s.start) * scale) for s in p.spans
                    if s.rank == rank and s.kind == kind]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolor=COLORS.get(kind, "#333333"),
                           edgecolor="white", linewidth=0.3)
        for end in p.ends:
            ax.axvline((end - t0) * scale, color="k", lw=0.6)
        ax.set_yticks(range(len(rows)), [f"r{r} {k}" for r, k in rows], fontsize=6)
        ax.invert_yaxis()
        ax.set_title(p.title, fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=6)
        ax.set_xlabel(unit, fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / height if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows(spans: Sequence[Span], max_ranks: int | None) -> list[tuple[int, str]]:
    ranks = sorted({s.rank for s in spans})[:max_ranks]
    kinds = {(s.rank, s.kind) for s in spans if s.rank in ranks}
    return sorted(kinds, key=lambda rk: (rk[0], _order(rk[1])))


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"

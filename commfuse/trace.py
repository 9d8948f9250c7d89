"""Timelines: spans of compute and communication, as a Chrome/Perfetto trace or a PNG Gantt chart.

Used by the executor's tracer (a measured run), the benchmarks and the simulator (a predicted
run). No torch needed.
"""

from __future__ import annotations

import json


class Tracer:
    """Spans for a Chrome/Perfetto trace: (track, name, start s, end s) on this process."""

    def __init__(self):
        self.spans: list[tuple[str, str, float, float]] = []

    def add(self, track: str, name: str, start: float, end: float) -> None:
        self.spans.append((track, name, start, end))


_ORDER = ("compute", "reduce", "host", "wait", "send", "recv", "collective")


def trace_events(spans) -> list[dict]:
    """The trace events of ``spans`` (`commfuse.sim.Span`s), times in microseconds."""
    events: list[dict] = []
    by_rank: dict[int, list] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    for rank in sorted(by_rank):
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        kinds = sorted({s.kind for s in by_rank[rank]},
                       key=lambda k: _ORDER.index(k) if k in _ORDER else len(_ORDER))
        for tid, kind in enumerate(kinds):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": kind}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in by_rank[rank]:
            events.append({"ph": "X", "pid": rank, "tid": kinds.index(s.kind), "name": s.label,
                           "ts": 1e6 * s.start, "dur": 1e6 * (s.end - s.start)})
    return events


def write_trace(spans, path: str) -> None:
    """Write ``spans`` as a Chrome trace JSON (open in ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(spans), "displayTimeUnit": "ms"}, f)

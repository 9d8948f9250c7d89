"""scripts/trace_waits.py on a trace written by `commfuse.trace.write_trace`."""

import pytest

from commfuse.trace import Span, write_trace
from script_module import load

trace_waits = load("trace_waits")


def test_waits_sum_each_ranks_blocked_time_within_each_step(tmp_path):
    spans = [Span(0, "step", "none", 0.0, 0.100), Span(0, "wait", "w", 0.010, 0.030),
             Span(0, "wait", "w", 0.050, 0.055), Span(0, "compute", "c", 0.0, 0.1),
             Span(0, "step", "commfuse", 0.200, 0.280), Span(0, "wait", "w", 0.210, 0.211),
             Span(1, "step", "none", 0.0, 0.090), Span(1, "wait", "w", 0.0, 0.040)]
    path = tmp_path / "t.trace.json"
    write_trace(spans, str(path))
    got = {(m, r): (step, blocked) for m, r, step, blocked in trace_waits.waits(str(path))}
    assert got[("none", 0)] == pytest.approx((100.0, 25.0))
    assert got[("commfuse", 0)] == pytest.approx((80.0, 1.0))
    assert got[("none", 1)] == pytest.approx((90.0, 40.0))

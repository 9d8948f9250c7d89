"""scripts/profile_tp_hf.py's breakdown of a step's spans into phases, fused ops, waits and the
rest."""

import pytest
from script_module import SCRIPTS, load

from commfuse.trace import Span


@pytest.fixture(scope="module")
def profile():
    import sys
    sys.path.insert(0, SCRIPTS)  # it imports bench_tp_hf as the scripts directory's module
    try:
        yield load("profile_tp_hf")
    finally:
        sys.path.remove(SCRIPTS)


def test_breakdown_counts_ops_and_waits_inside_each_phase(profile):
    spans = [Span(0, "step", "forward", 0.0, 1.0), Span(0, "step", "backward", 1.0, 3.0),
             Span(0, "step", "optimizer", 3.0, 3.5),
             Span(0, "op", "ag_matmul auto", 0.1, 0.4), Span(0, "wait", "w", 0.3, 0.35),
             Span(0, "compute", "c", 0.1, 0.3),  # inside an op: not counted again
             Span(0, "op", "matmul_rs auto", 1.5, 2.5), Span(0, "wait", "w", 2.0, 2.2)]
    d = profile.breakdown(spans)
    assert d["forward"] == pytest.approx(1.0) and d["backward"] == pytest.approx(2.0)
    assert d["forward ops"] == pytest.approx(0.3) and d["forward waits"] == pytest.approx(0.05)
    assert d["forward rest"] == pytest.approx(0.7)
    assert d["backward ops"] == pytest.approx(1.0) and d["backward waits"] == pytest.approx(0.2)
    assert d["optimizer ops"] == 0 and d["optimizer rest"] == pytest.approx(0.5)

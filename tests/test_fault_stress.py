"""The failure path under CPU load: a few runs of each fault kind beside busy processes.

`commfuse.testbed.stress` runs these cases by the hundred (docs/benchmarks/reliability-stress.md);
here a bounded subset (3 runs per kind, 2 spinning processes beside the ranks) checks that on a
loaded machine every survivor still raises `commfuse.CommFuseError` within the op's timeout +
slack: no hang, no silent success, no other error. The cases start at the backend's
collectives, auto's agreement on the method and checked mode's shapes (`stress.CASES`), the
waits that once kept the group's timeout instead of the op's.
"""

from __future__ import annotations

import pytest

from commfuse.testbed import faults, stress
from marks import needs_netns

RUNS = 3
TIMEOUT = 1.0  # the ops' timeout (seconds)
SLACK = 5.0  # a survivor's error may come this much after the timeout on a loaded machine
FIRST = 7  # stress.CASES from: none with the backend's collective, auto, checked mode


@pytest.mark.parametrize("kind", ["kill", "stall",
                                  pytest.param("linkdown", marks=needs_netns)])
def test_every_survivor_raises_in_time_under_load(kind):
    results = stress.run([kind], RUNS, load=2, load_kind="spin", timeout_s=TIMEOUT,
                         hang_s=30.0, seed=44, first=FIRST)
    runs = results[kind]
    assert len(runs) == RUNS
    bad = stress.failed(results, SLACK)
    assert not bad, "\n".join(
        f"{r.case.label()}: {r.outcome}, worst {r.worst_s}: "
        + "; ".join(f"rank {p.rank} {p.outcome} {p.message[-800:]}" for p in r.reports)
        for r in bad)
    assert {r.outcome for r in runs} == {"raised"}
    assert all(isinstance(p.where, dict) for r in runs for p in r.reports)


def test_the_cases_cover_every_fault_and_method():
    plan = [c for k in faults.FAULTS for c in stress.cases(k, len(stress.CASES), 0, TIMEOUT)]
    assert {c.method for c in plan} == {"commfuse", "decompose", "sliced", "none", "auto"}
    assert {c.world for c in plan} == {2, 3} and {c.fault for c in plan} == set(faults.FAULTS)
    assert {c.at for c in plan} <= set(range(stress.MAX_AT + 1)) and 0 in {c.at for c in plan}

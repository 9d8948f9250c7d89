"""Every op x method x dim x dtype on 2, 3 and 4 gloo ranks, against the unsharded reference.

Each world size is started once (real processes, `commfuse.testbed.spawn.run_local`) and runs all
cases; each case is then reported as its own test, failing if any rank saw a difference.
"""

import functools

import pytest

from commfuse.testbed.spawn import run_local
from dist_cases import all_cases, run_cases

CASES = all_cases()


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(run_cases, world, CASES, timeout=900, pg_timeout_s=60)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_unsharded_reference(world, case):
    problems = {r: res[case.id] for r, res in enumerate(results(world)) if res[case.id]}
    assert not problems, problems

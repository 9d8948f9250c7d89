"""`commfuse.testbed.spawn.run_local` with ranks forked from its server: each call's ranks
are new processes that see the caller's environment and write to its stdout as it is at the
call, start from the state the server imported (nothing one call changed reaches the next),
and a run past its timeout is killed. (A rank's exception: tests/test_errors.py.)"""

import os
import time

import pytest

from commfuse.testbed import spawn
from commfuse.testbed.spawn import run_local


def _look(rank, world, patch):
    import torch

    from commfuse.ops import auto

    seen = dict(pid=os.getpid(), env=os.environ.get("COMMFUSE_TEST_SPAWN"),
                threads=torch.get_num_threads(), patched=hasattr(auto, "_spawn_test_mark"),
                choices=len(auto._CHOICES))
    print(f"rank {rank} writes here", flush=True)
    if patch:  # what a careless test might leave behind in its ranks
        auto._spawn_test_mark = True
        auto._CHOICES[("left", "behind")] = ("none", {})
        os.environ["COMMFUSE_TEST_SPAWN"] = "left behind"
        torch.set_num_threads(2)
    return seen


def test_each_call_gets_new_ranks_with_the_callers_environment_and_output(monkeypatch, capfd):
    assert spawn._START["method"] == "forkserver"  # as conftest.py sets it
    monkeypatch.setenv("COMMFUSE_TEST_SPAWN", "first")
    first = run_local(_look, 2, True, timeout=120)
    monkeypatch.setenv("COMMFUSE_TEST_SPAWN", "second")  # after the server started
    second = run_local(_look, 2, False, timeout=120)
    assert [s["env"] for s in first + second] == ["first"] * 2 + ["second"] * 2
    assert not {s["pid"] for s in first} & {s["pid"] for s in second}
    assert all(not s["patched"] and s["choices"] == 0 and s["threads"] == 1 for s in second)
    out = capfd.readouterr().out
    assert out.count("rank 0 writes here") == 2 and out.count("rank 1 writes here") == 2


def _sleep(rank, world):
    time.sleep(600 if rank == 1 else 0)


def test_a_run_past_its_timeout_is_killed_and_the_next_runs():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish"):
        run_local(_sleep, 2, timeout=3)
    assert time.monotonic() - t0 < 60
    assert run_local(_look, 2, False, timeout=120)[1]["env"] is None


def test_the_start_method_is_checked():
    with pytest.raises(ValueError, match="forkserver' or 'spawn'"):
        spawn.start_ranks("fork")

"""Fault injection: a rank killed or stalled in the middle of an op, or its link cut.

Every surviving rank must raise `commfuse.CommFuseError` naming the op, the step and the peer
within the configured timeout (plus a margin for this shared machine); no rank may hang.
``commfuse train`` with a rank killed exits non-zero and its last checkpoint resumes.
Each case runs real gloo ranks forked by `commfuse.testbed.faults.run_case` (the victim
strikes at its 2nd GEMM, inside an op); the link case runs in the emulated network's
namespaces (root and iproute2). The deadlines themselves (a wait that gives up, a backend
wait that overruns, a send never taken) are checked in-process first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import pytest

from commfuse.runtime import collectives, gloo
from commfuse.schedule import OPS
from commfuse.testbed import faults, stress
from marks import needs_netns

TIMEOUT = 1.0  # the ops' `timeout` option in every case (seconds)
# Scheduling slack on a loaded, shared 2-core machine: generous, since what the bounds tell
# apart is the op's timeout from the process group's (faults.PG_TIMEOUT_S) or a hang, not speed.
MARGIN = 40.0
DUAL = {"ag_matmul": "matmul_rs", "matmul_rs": "ag_matmul", "matmul_a2a": "a2a_matmul",
        "a2a_matmul": "matmul_a2a"}
METHODS = [("commfuse", ()), ("commfuse", (("topology", "direct"),)), ("decompose", ()),
           ("sliced", ()), ("none", ())]
ROOT = Path(__file__).resolve().parents[1]


# --- the deadlines, in-process ----------------------------------------------------------------

class _Work:
    """A stand-in for a backend work: ``wait`` returns ``result`` after ``delay_s``."""

    def __init__(self, result: bool = True, delay_s: float = 0.0):
        self.result, self.delay_s, self.timeouts = result, delay_s, []

    def wait(self, timeout=None) -> bool:
        self.timeouts.append(timeout)
        time.sleep(self.delay_s)
        return self.result


def test_a_wait_that_gives_up_raises():
    # gloo's wait returns False when the backend aborts it: the buffer was never filled
    with pytest.raises(RuntimeError, match="gave up the wait"):
        gloo.wait_work(_Work(result=False), time.monotonic() + 5)


def test_a_deadline_never_becomes_no_timeout():
    # c10d reads a timeout that rounds to 0 ms as none at all: a passed deadline is 1 ms
    work = _Work()
    gloo.wait_work(work, time.monotonic() - 10)
    assert work.timeouts[0] >= timedelta(milliseconds=1)


def test_a_backend_wait_that_overruns_its_timeout_still_ends():
    slow = _Work(delay_s=30.0)  # as gloo's reduce_scatter: the wait ignores its timeout
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not complete within 0\.\d+ s"):
        gloo.wait_work(collectives.Guarded(slow), time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 0.2 + collectives.Guarded.GRACE_S + 5


def test_a_send_the_peer_never_takes_raises():
    never: Future = Future()  # the sender thread's isend never returns
    with pytest.raises(TimeoutError, match="did not take the message within 0.2 s"):
        gloo.PendingSend(never, group=None).wait(timedelta(seconds=0.2))


# --- a rank killed or stalled in an op ---------------------------------------------------------

def _cases():
    out = []
    for i, (method, opts) in enumerate(METHODS):
        out.append(("kill", 2, OPS[i % 4], method, opts))
        out.append(("stall", 2, OPS[(i + 2) % 4], method, opts))
    out += [("kill", 3, "ag_matmul", "commfuse", ()), ("stall", 3, "matmul_rs", "commfuse", ()),
            ("kill", 3, "a2a_matmul", "sliced", ()), ("stall", 3, "ag_matmul", "none", ()),
            # the backend's collectives, and what runs before the schedule (the victim
            # strikes before the op): auto's agreement on the method, checked mode's shapes
            ("stall", 2, "matmul_rs", "none", (("collective", "backend"),)),
            ("stall", 3, "matmul_rs", "auto", ()),
            ("kill", 3, "matmul_a2a", "commfuse", (("check", True),))]
    return out


def _at(method: str, opts) -> int:
    """The victim's GEMM to strike at: 0 (before the op) where the op exchanges first."""
    return 0 if method == "auto" or dict(opts).get("check") else 2


def _id(case):
    fault, world, op, method, opts = case
    return f"{fault}-w{world}-{op}-{method}{''.join(f'-{v}' for _, v in opts)}"


def _check(res: faults.RunResult, op: str, method: str) -> None:
    """Every survivor raised within the bound, naming the op, its method, the step, a peer."""
    for rep in res.reports:
        msg = rep.message
        assert rep.outcome == "raised", (rep.rank, rep.outcome, msg[-3000:])
        assert rep.elapsed_s < TIMEOUT + MARGIN, f"rank {rep.rank}: {rep.elapsed_s:.1f} s: {msg}"
        where = rep.where
        assert where["op"] in (op, DUAL[op]) and where["rank"] == rep.rank, (where, msg)
        assert re.search(rf"commfuse ({op}|{DUAL[op]}) ", msg), msg
        if where["step"] is not None:  # in the schedule: "(method=..., rank r of W) failed at
            assert where["method"] == method, (where, msg)  # step i waiting for ... rank p"
            assert re.search(rf"\(method={method}, rank \d of \d\) failed at step -?\d+", msg), msg
            if res.case.world == 2:  # the only peer (the victim, or its survivor): named
                assert f"rank {1 - rep.rank}" in msg.split("waiting for", 1)[1], msg
        else:  # before it: auto's agreement on the method, checked mode's shapes
            assert re.search(r"failed (agreeing on the method|exchanging the shapes)", msg), msg


@pytest.mark.parametrize("case", _cases(), ids=[_id(c) for c in _cases()])
def test_survivors_raise_within_the_timeout(case):
    fault, world, op, method, opts = case
    res = faults.run_case(faults.Case(fault, op, method, opts, world, victim=1,
                                      at=_at(method, opts), timeout_s=TIMEOUT), hang_s=MARGIN)
    assert res.outcome == "raised", [(r.rank, r.outcome, r.message[-2000:]) for r in res.reports]
    _check(res, op, method)


def test_a_peer_dead_before_the_op_is_noticed():
    """Issue 44's case: 3 ranks, GEMM -> RS, a peer killed before the op."""
    res = faults.run_case(faults.Case("kill", "matmul_rs", "commfuse", (), 3, victim=1, at=0,
                                      timeout_s=TIMEOUT), hang_s=MARGIN)
    _check(res, "matmul_rs", "commfuse")


# --- the link: the victim takes its own interface down (emulated network) ----------------------

@needs_netns
@pytest.mark.parametrize("op, method", [("matmul_rs", "commfuse"), ("ag_matmul", "sliced")])
def test_link_down_raises_on_both_sides(op, method):
    with stress.Network(2) as net:
        res = faults.run_case(faults.Case("linkdown", op, method, (), 2, victim=1, at=2,
                                          timeout_s=TIMEOUT), hang_s=MARGIN, network=net)
    assert [r.rank for r in res.reports] == [0, 1]  # both ends must raise
    _check(res, op, method)


# --- training: a rank killed mid-run ----------------------------------------------------------

def _ranks(pid: int) -> list[int]:
    """The rank processes under ``pid``: started by spawn (``spawn_main`` in their command
    line) or forked by a fork server (`commfuse.testbed.spawn`'s default)."""
    procs = {}  # pid -> (parent, command line)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                procs[int(d.name)] = (int(stat.rsplit(")", 1)[1].split()[1]),
                                      (d / "cmdline").read_bytes())
            except OSError:
                continue
    under, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, _) in procs.items() if pp == parent]
        under.update(kids)
        todo += kids
    return sorted(p for p in under if b"spawn_main" in procs[p][1]
                  or b"forkserver" in procs.get(procs[p][0], (0, b""))[1])


TRAIN = ("--tp", "2", "--batch-size", "2", "--seq-len", "32", "--peak-flops", "1e9",
         "--hardware", "cpu-testbed", "--link", "loopback")


def test_train_exits_nonzero_and_its_checkpoint_resumes(tmp_path, command):
    """The installed command's process (``python -m commfuse.train``) with a rank killed
    exits 1 naming its last checkpoint; ``commfuse train --resume`` (in this process, its
    ranks forked as the command forks them) continues from it."""
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "commfuse.train", *TRAIN, "--steps", "100000",
                             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                             "--timeout", "5"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # the start (imports, ranks) on a loaded machine
        while not (ckpt / "latest").is_file() or (ckpt / "latest").read_text() < "step-00000002":
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()  # a run of 100000 steps: read what it printed once it is gone
                pytest.fail(f"no step-2 checkpoint: {proc.communicate()[1][-3000:]}")
            time.sleep(0.1)
        ranks = _ranks(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and time.monotonic() - t0 < 5 + MARGIN, err[-3000:]
    saved = (ckpt / "latest").read_text().strip()
    assert f"last complete checkpoint: {ckpt / saved} (continue with --resume)" in err, err
    step = int(saved.split("-")[1])
    resumed = command("train", *TRAIN, "--steps", str(step + 2), "--checkpoint-dir", str(ckpt),
                      "--resume", "--metrics-json", str(tmp_path / "m.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [m["step"] for m in json.loads((tmp_path / "m.json").read_text())["steps"]]
    assert steps == [step + 1, step + 2]


def test_a_crash_while_saving_leaves_latest_intact(tmp_path, monkeypatch):
    """The save of step 4 dies half-written: ``latest`` still names step 2, which resumes."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from commfuse import train

    small = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    cfg = train.TrainConfig(steps=6, batch_size=2, seq_len=16, model=small, progress=False,
                            exposed_iters=0, peak_flops=1e9, hardware="cpu-testbed",
                            checkpoint_dir=str(tmp_path),
                            checkpoint_every=2)
    real, calls = dcp.save, [0]

    def dying_save(state, checkpoint_id, **kw):
        calls[0] += 1
        if calls[0] == 2:  # write part of it, then crash
            Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
            Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half a shard")
            raise OSError("disk full")
        return real(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        train.train_rank(0, 1, cfg)
    assert (tmp_path / "latest").read_text() == "step-00000002"
    monkeypatch.setattr(dcp, "save", real)
    steps = [m["step"] for m in train.train_rank(0, 1, dataclasses.replace(cfg, resume=True))]
    assert steps == [3, 4, 5, 6] and (tmp_path / "latest").read_text() == "step-00000006"

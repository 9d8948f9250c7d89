"""Fault injection: a rank killed or stalled in the middle of an op, or its link cut.

Every surviving rank must raise `commfuse.CommFuseError` naming the op, the step and the peer
within the configured timeout (plus a margin for this shared machine); no rank may hang.
``commfuse train`` with a rank killed exits non-zero and its last checkpoint resumes.
Each case starts real ranks (`commfuse.testbed.spawn.run_local` with ``victims``); the link case runs
on the emulated cluster (root and iproute2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torch

import commfuse
from commfuse.ops import registry
from commfuse.runtime import modes
from commfuse.schedule import OPS
from commfuse.testbed.spawn import run_local
from marks import needs_netns

TIMEOUT = 2.0  # the ops' `timeout` option in every case (seconds)
# Scheduling slack on a loaded, shared 2-core machine: generous, since what the bounds tell
# apart is the op's timeout from the process group's (PG_TIMEOUT) or a hang, not speed.
MARGIN = 40.0
PG_TIMEOUT = 120.0
DUAL = {"ag_matmul": "matmul_rs", "matmul_rs": "ag_matmul", "matmul_a2a": "a2a_matmul",
        "a2a_matmul": "matmul_a2a"}
METHODS = [("commfuse", {}), ("commfuse", {"topology": "direct"}), ("decompose", {}),
           ("sliced", {}), ("none", {})]
ROOT = Path(__file__).resolve().parents[1]


def inject(fault: str, at: int = 2) -> None:
    """At this process's ``at``-th GEMM (inside an op, after its first transfers were posted)
    die (``kill``: SIGKILL, no goodbye), stop answering (``stall``), or take down its own
    network interface and go on (``link_down``: on the emulated cluster)."""
    real, calls = modes.gemm, [0]

    def gemm(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "link_down":
                subprocess.run(["ip", "link", "set", "dev", os.environ["GLOO_SOCKET_IFNAME"],
                                "down"], check=True)
            else:
                time.sleep(3600)
        return real(*args, **kwargs)

    modes.gemm = gemm


def run_op(op: str, method: str, opts: dict, world: int, steps: int = 2) -> None:
    """``steps`` x ``op`` forward and backward on small random inputs (the same shapes on
    every rank; two steps, so that communication follows any GEMM of the first)."""
    a = torch.randn(4 * world, 3, 8, requires_grad=True)
    for _ in range(steps):
        b = torch.randn(*registry.b_shape(op, world, 8, 6))
        out = registry.call(op, a, b, method, opts, timeout=TIMEOUT)
        out.sum().backward()


def _faulty(rank, world, op, method, opts, fault, victim):
    if rank == victim:
        inject(fault)
    t0 = time.monotonic()
    try:
        run_op(op, method, opts, world)
    except commfuse.CommFuseError as e:
        return time.monotonic() - t0, str(e)
    return time.monotonic() - t0, None


def _cases():
    out = []
    for i, (method, opts) in enumerate(METHODS):
        out.append(("kill", 2, OPS[i % 4], method, opts))
        out.append(("stall", 2, OPS[(i + 2) % 4], method, opts))
    out += [("kill", 3, "ag_matmul", "commfuse", {}), ("stall", 3, "matmul_rs", "commfuse", {}),
            ("kill", 3, "a2a_matmul", "sliced", {}), ("stall", 3, "ag_matmul", "none", {})]
    return out


def _id(case):
    fault, world, op, method, opts = case
    return f"{fault}-w{world}-{op}-{method}{''.join(f'-{v}' for v in opts.values())}"


@pytest.mark.parametrize("case", _cases(), ids=[_id(c) for c in _cases()])
def test_survivors_raise_within_the_timeout(case):
    fault, world, op, method, opts = case
    victim = 1
    out = run_local(_faulty, world, op, method, opts, fault, victim, victims=(victim,),
                    timeout=240, pg_timeout_s=PG_TIMEOUT)
    for rank, res in enumerate(out):
        if rank == victim:
            continue
        elapsed, msg = res
        assert msg is not None, f"rank {rank} finished although rank {victim} {fault}ed"
        assert elapsed < TIMEOUT + MARGIN, f"rank {rank} took {elapsed:.1f} s: {msg}"
        assert re.search(rf"commfuse ({op}|{DUAL[op]}) \(method={method}", msg), msg
        assert re.search(r"at step \d+", msg) and re.search(r"rank \d", msg), msg
        if world == 2:  # the only peer is the victim: the error must name it
            assert "rank 1" in msg.split("waiting for", 1)[1], msg


# --- the link: the victim takes its own interface down (emulated cluster) --------------------


_LINK_DOWN = """\
import json, os, sys, time
sys.path.insert(0, {tests!r})
import torch.distributed as dist
import commfuse
from test_faults import inject, run_op
dist.init_process_group("gloo")
commfuse.duplex()
rank = dist.get_rank()
if rank == 1:  # at the 2nd GEMM, cut this rank's link (it is in its own network namespace)
    inject("link_down")
t0, msg = time.monotonic(), None
try:
    run_op({op!r}, {method!r}, {{}}, 2)
except commfuse.CommFuseError as e:
    msg = str(e)
with open(os.path.join({out!r}, f"rank{{rank}}.json"), "w") as f:
    json.dump({{"elapsed": time.monotonic() - t0, "msg": msg}}, f)
os._exit(0)  # the group cannot be torn down over a dead link
"""


@needs_netns
@pytest.mark.parametrize("op, method", [("matmul_rs", "commfuse"), ("ag_matmul", "sliced")])
def test_link_down_raises_on_both_sides(tmp_path, op, method):
    script = tmp_path / "rank.py"
    script.write_text(_LINK_DOWN.format(tests=str(ROOT / "tests"), op=op, method=method,
                                        out=str(tmp_path)))
    proc = subprocess.run([sys.executable, "-m", "commfuse.testbed.launch", "--nproc", "2", "--link",
                           "1gbit", "--timeout", "60", "--", sys.executable, str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=90)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, rep in enumerate(reports):
        assert rep["msg"] is not None, (rank, proc.stderr[-2000:])
        assert rep["elapsed"] < TIMEOUT + MARGIN, rep
        assert re.search(rf"commfuse ({op}|{DUAL[op]}) \(method={method}.*at step \d+", rep["msg"])


# --- training: a rank killed mid-run ----------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
                out.append(int(d.name))
    return out


def _train(*flags: str) -> list[str]:
    return [sys.executable, "-m", "commfuse.train", "--tp", "2", "--batch-size", "2",
            "--seq-len", "32", "--peak-flops", "1e9", "--hardware", "cpu-testbed", "--link",
            "loopback", *flags]


def test_train_exits_nonzero_and_its_checkpoint_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_train("--steps", "100000", "--checkpoint-dir", str(ckpt),
                                   "--checkpoint-every", "3", "--timeout", "5"),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "latest").is_file() or (ckpt / "latest").read_text() < "step-00000006":
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.1)
        ranks = _children(proc.pid)
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
    resumed = subprocess.run(_train("--steps", str(step + 2), "--checkpoint-dir", str(ckpt),
                                    "--resume", "--metrics-json", str(tmp_path / "m.json")),
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
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

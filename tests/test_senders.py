"""The sender threads of `commfuse.runtime.gloo`: a send blocked on a stalled peer does not
keep the process from exiting, and a destroyed group's threads and twin are not reused by a
group created after it."""

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from commfuse.runtime import gloo
from commfuse.testbed.spawn import run_local

ROOT = Path(__file__).resolve().parents[1]

_STALLED_PEER = """\
import datetime, sys, threading, time
import torch, torch.distributed as dist
import commfuse
from commfuse.runtime import gloo
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
if rank == 1:  # the stalled peer
    time.sleep(3600)
# a send to it stuck in its sender thread (as a gloo write to a peer that stopped reading)
gloo._sender(dist.group.WORLD, 1).submit(threading.Event().wait)
try:
    commfuse.fused_matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 6), "sum", 0,
                                         timeout=1)
except commfuse.CommFuseError as e:
    print("raised:", e, flush=True)
sys.exit(0)  # a normal exit: the stuck send must not hold it up
"""


def test_a_send_blocked_on_a_stalled_peer_does_not_hold_up_exit(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_STALLED_PEER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=60)  # hangs for ever with non-daemon senders
    except subprocess.TimeoutExpired:
        out, err = "", "rank 0 did not exit"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "raised:" in out and procs[0].returncode == 0, (out, err[-2000:])


def _threads(*groups) -> list[threading.Thread]:
    """The sender threads of ``groups`` (a send goes out on the group or on its twin)."""
    return [s.thread for g in groups for s in gloo._SENDERS.get(g, {}).values()]


def _recreate(rank, world):
    """A group used (twin, senders), destroyed, collected; then a new group over the same
    ranks: it gets its own twin and senders, and the old group's threads have stopped."""
    t = torch.arange(4.0) + rank

    def exchange(group) -> None:
        got = torch.empty(4)
        works = gloo.post([dist.P2POp(dist.isend, t, 1 - rank, group),
                           dist.P2POp(dist.irecv, got, 1 - rank, group)], t.device)
        for w in works:
            w.wait()
        assert torch.equal(got, torch.arange(4.0) + 1 - rank)

    old = dist.new_group([0, 1])
    gloo.duplex(old)
    exchange(old)
    old_id, old_twin = id(old), gloo._TWINS[old]
    old_threads = _threads(old, old_twin)
    assert old_threads and all(th.daemon and th.is_alive() for th in old_threads)
    dist.barrier()
    dist.destroy_process_group(old)
    del old
    gc.collect()
    for th in old_threads:
        th.join(10)
    stopped = not any(th.is_alive() for th in old_threads)
    new = dist.new_group([0, 1])
    fresh = new not in gloo._TWINS and new not in gloo._SENDERS  # nothing inherited
    gloo.duplex(new)
    exchange(new)
    new_threads = _threads(new, gloo._TWINS[new])
    assert new_threads
    return dict(stopped=stopped, fresh=fresh, own_twin=gloo._TWINS[new] is not old_twin,
                own_threads=not set(new_threads) & set(old_threads), same_id=id(new) == old_id,
                daemon=all(th.daemon for th in threading.enumerate()
                           if th.name.startswith("commfuse-send")))


def test_a_recreated_group_gets_its_own_twin_and_senders():
    for res in run_local(_recreate, 2, timeout=120):
        res.pop("same_id")  # whether the address was reused: either way nothing is inherited
        assert res == dict(stopped=True, fresh=True, own_twin=True, own_threads=True,
                           daemon=True), res

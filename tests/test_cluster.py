"""The emulated-cluster launcher (commfuse.testbed.launch).

Spec and CLI tests need no processes. The rest start real ranks: on loopback, or each in its own
network namespace (skipped without root and iproute2), and check exit codes, the measured
bandwidth of shaped links, and that nothing of a run's network is left behind however it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from commfuse.testbed import cpu as cluster_cpu, links, net as cluster_net
from commfuse.testbed.launch import (ALLOCATOR_ENV, ClusterSpec, EmulationUnavailable, LinkSpec, add_launch_arguments,
                                     cleanup_stale, launch, main_launch, spec_from_args)
from marks import needs_netns


ROOT = Path(__file__).resolve().parents[1]

# Each rank writes its env (and whatever the snippet adds) to OUT/rank<r>.json.
_PRELUDE = """\
import json, os, sys, time
OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
INFO = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "COMMFUSE_EMULATED",
        "COMMFUSE_LINK", "COMMFUSE_RUN_ID")}
INFO["pid"] = os.getpid()
def report(**kw):
    INFO.update(kw)
    with open(f"{OUT}/rank{RANK}.json.tmp", "w") as f:
        json.dump(INFO, f)
    os.replace(f"{OUT}/rank{RANK}.json.tmp", f"{OUT}/rank{RANK}.json")
"""

_ALL_REDUCE = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.full((4,), float(RANK + 1))
dist.all_reduce(x)
report(sum=x.tolist())
dist.destroy_process_group()
"""

# Bits/s from src to dst: the best of 3 transfers of NBYTES, each timed by src from the send
# to a 1-element ack (after a warm-up in both directions). The best, because the link caps
# every transfer while a busy CPU (other tests on this box) only ever slows one down.
_BANDWIDTH = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
def timed(src, dst, nbytes, reps=3):
    buf, ack, rates = torch.empty(nbytes, dtype=torch.uint8), torch.zeros(1), []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if RANK == src:
            dist.send(buf, dst); dist.recv(ack, dst)
        elif RANK == dst:
            dist.recv(buf, src); dist.send(ack, src)
        rates.append(nbytes * 8 / (time.perf_counter() - t0))
    return max(rates)
timed(0, 1, 1 << 20, 1), timed(1, 0, 1 << 20, 1)
report(up=timed(0, 1, NBYTES), down=timed(1, 0, NBYTES))
dist.destroy_process_group()
"""


def _script(tmp_path: Path, body: str, **consts) -> list[str]:
    """argv running PRELUDE + consts + body as a rank, writing results under tmp_path."""
    path = tmp_path / "rank_main.py"
    defs = "".join(f"{k} = {v!r}\n" for k, v in consts.items())
    path.write_text(_PRELUDE + defs + textwrap.dedent(body))
    return [sys.executable, str(path), str(tmp_path)]


def _reports(tmp_path: Path, nproc: int) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def _leftovers(run_id: str) -> list[str]:
    """Anything of run ``run_id`` still present: namespaces, root-namespace links, state."""
    found = [n for n in cluster_net.list_netns() if run_id in n]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += re.findall(rf"\bcf{run_id}\w*", links)
    if os.path.exists(os.path.join(cluster_net.STATE_DIR, f"{run_id}.json")):
        found.append("state file")
    return found


def _launcher(tmp_path: Path, body: str, *opts: str) -> subprocess.Popen:
    """The launcher as its own process: python -m commfuse.testbed.launch OPTS -- rank script."""
    return subprocess.Popen([sys.executable, "-m", "commfuse.testbed.launch", *opts, "--",
                             *_script(tmp_path, body)], cwd=ROOT)


def _wait_for(paths: list[Path], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"ranks did not start: {paths}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- specs and CLI: no processes -----------------------------------------------------------

def test_link_spec_parses_tc_units():
    link = LinkSpec(rate="1gbit", delay="50us", jitter="10us")
    assert (link.rate_bps, link.delay_us, link.jitter_us) == (10**9, 50.0, 10.0)
    assert LinkSpec(rate="200mbit", delay="1.5ms").delay_us == 1500.0
    assert LinkSpec(rate="125mbps", delay="0", jitter="0").rate_bps == 10**9
    assert "1gbit" in LinkSpec().describe()


@pytest.mark.parametrize("kwargs", [dict(rate="fast"), dict(rate="10"), dict(rate="1 gigabit"),
                                    dict(rate="-1mbit"), dict(rate="1kbit"), dict(delay="5"),
                                    dict(delay="1 hour"), dict(delay="50us", jitter="60us")])
def test_link_spec_rejects(kwargs):
    with pytest.raises(ValueError):
        LinkSpec(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(nproc=0), "nproc"), (dict(nproc=300), "nproc"), (dict(nproc="2"), "nproc"),
    (dict(link="1gbit"), "LinkSpec"), (dict(straggler_rank=1), "together"),
    (dict(straggler_rank=2, straggler_link=LinkSpec()), "not one of"),
    (dict(straggler_link=LinkSpec()), "together"),
    (dict(straggler_rank=1, straggler_link="1mbit"), "LinkSpec"),
    (dict(straggler_rank=1, straggler_link=LinkSpec(), emulate=False), "emulate")])
def test_cluster_spec_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**kwargs)


def test_tbf_params_scale_with_rate():
    b1, l1 = links.tbf_params(10**9)
    b10, l10 = links.tbf_params(10**10)
    assert 16 * 1024 <= b1 < b10 and 1024 * 1024 <= l1 < l10 and l1 >= 4 * b1


def test_spec_from_args():
    parser = add_launch_arguments(argparse.ArgumentParser())
    args = parser.parse_args("--nproc 3 --link 200mbit --straggler-rank 2 --straggler-delay 1ms "
                             "--no-pin --timeout 9 -- python -m mod --x".split())
    spec = spec_from_args(args)
    assert spec.nproc == 3 and spec.pin is False and args.timeout == 9
    assert spec.link_for(0) == LinkSpec("200mbit", "50us")
    assert spec.link_for(2) == LinkSpec("200mbit", "1ms")
    assert args.command[-4:] == ["python", "-m", "mod", "--x"]
    with pytest.raises(ValueError, match="straggler-rank"):
        spec_from_args(parser.parse_args("--straggler-link 1mbit -- x".split()))
    with pytest.raises(ValueError):
        launch(ClusterSpec(), [])


# --- loopback -----------------------------------------------------------------------------

def test_without_root_raises_and_cli_falls_back_to_loopback(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    argv = _script(tmp_path, "report()")
    with pytest.raises(EmulationUnavailable, match="root"):
        launch(ClusterSpec(nproc=2), argv)
    args = add_launch_arguments(argparse.ArgumentParser()).parse_args(["--", *argv])
    assert main_launch(args) == 0
    info = _reports(tmp_path, 2)
    assert [i["RANK"] for i in info] == ["0", "1"] and info[1]["WORLD_SIZE"] == "2"
    assert {(i["MASTER_ADDR"], i["GLOO_SOCKET_IFNAME"], i["COMMFUSE_EMULATED"],
             i["COMMFUSE_LINK"]) for i in info} == {("127.0.0.1", "lo", "0", "loopback")}


def test_loopback_failure_and_timeout(tmp_path):
    spec = ClusterSpec(nproc=2, emulate=False)
    t0 = time.monotonic()
    assert launch(spec, _script(tmp_path, "os._exit(3) if RANK == 1 else time.sleep(60)")) == 3
    assert launch(spec, _script(tmp_path, "time.sleep(60)"), timeout=0.5) == 124
    assert time.monotonic() - t0 < 55  # had it waited for a sleeping rank: over 60 s


_REFILL = """\
import resource, torch
def faults(mib):  # page faults of filling a fresh buffer of `mib` MiB, after one was freed
    torch.empty(mib << 18).fill_(1.0)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(mib << 18).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
report(env={k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                           "OMP_NUM_THREADS")}, big=faults(32))
"""


def test_ranks_get_the_allocator_settings_and_big_buffers_stay_fresh(tmp_path, monkeypatch):
    """Every rank gets `ALLOCATOR_ENV` where the caller set none (a variable the caller set
    wins); buffers of 32 MiB are still fresh memory each time, as the simulator charges
    (`Hardware.first_touch_bytes`)."""
    from commfuse.sim.hardware import Hardware
    assert int(ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"]) == Hardware.first_touch_bytes
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345678")
    assert launch(ClusterSpec(nproc=2, emulate=False), _script(tmp_path, _REFILL), timeout=120) == 0
    for info in _reports(tmp_path, 2):
        assert info["env"] == {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                               "MALLOC_TRIM_THRESHOLD_": "12345678", "OMP_NUM_THREADS": "1"}
        assert info["big"] > (32 << 20) // 4096 // 2, info  # 4 KiB pages: 8192 when fresh


# --- emulated network -----------------------------------------------------------------------

@needs_netns
def test_emulated_all_reduce(tmp_path):
    assert launch(ClusterSpec(nproc=2), _script(tmp_path, _ALL_REDUCE)) == 0
    info = _reports(tmp_path, 2)
    assert all(i["sum"] == [3.0] * 4 for i in info)
    run_id = info[0]["COMMFUSE_RUN_ID"]
    assert info[0]["GLOO_SOCKET_IFNAME"] == f"cf{run_id}r0"
    assert info[1]["MASTER_ADDR"] == info[0]["MASTER_ADDR"].rsplit(".", 1)[0] + ".1"
    assert info[0]["MASTER_ADDR"].startswith(("198.18.", "198.19."))
    assert info[0]["COMMFUSE_EMULATED"] == "1" and "1gbit" in info[0]["COMMFUSE_LINK"]
    assert _leftovers(run_id) == []


@needs_netns
@pytest.mark.parametrize("link, straggler, nbytes", [("200mbit", "100mbit", 8 << 20),
                                                     ("1gbit", "200mbit", 16 << 20)])
def test_shaped_bandwidth_and_straggler(tmp_path, link, straggler, nbytes):
    """rank 0 -> 1 goes out on rank 0's link, 1 -> 0 on rank 1's (the straggler's)."""
    spec = ClusterSpec(nproc=2, link=LinkSpec(link, "0"), straggler_rank=1,
                       straggler_link=LinkSpec(straggler, "0"))
    assert launch(spec, _script(tmp_path, _BANDWIDTH, NBYTES=nbytes)) == 0
    rates = _reports(tmp_path, 2)[0]
    print(f"\nmeasured {nbytes >> 20} MiB over gloo: 0->1 {rates['up'] / 1e6:.0f} Mbit/s on "
          f"{link}, 1->0 {rates['down'] / 1e6:.0f} Mbit/s on {straggler}")
    for rate, nominal in ((rates["up"], link), (rates["down"], straggler)):
        assert 0.5 <= rate / links.parse_rate(nominal) <= 1.2


@needs_netns
def test_rank_failure_and_timeout_tear_down(tmp_path):
    t0 = time.monotonic()
    # rank 1 fails once rank 0 has reported (under load rank 0 may start late)
    body = """\
    report()
    if RANK == 1:
        end = time.monotonic() + 30
        while not os.path.exists(f"{OUT}/rank0.json") and time.monotonic() < end:
            time.sleep(0.01)
        os._exit(3)
    time.sleep(60)
    """
    assert launch(ClusterSpec(nproc=2), _script(tmp_path, body)) == 3
    info = _reports(tmp_path, 2)
    assert _leftovers(info[0]["COMMFUSE_RUN_ID"]) == [] and not _alive(info[0]["pid"])
    (tmp_path / "t").mkdir()
    assert launch(ClusterSpec(nproc=2), _script(tmp_path / "t", "report(); time.sleep(60)"),
                  timeout=3.0) == 124
    info = _reports(tmp_path / "t", 2)
    assert _leftovers(info[0]["COMMFUSE_RUN_ID"]) == [] and not _alive(info[1]["pid"])
    assert time.monotonic() - t0 < 55  # had it waited for a sleeping rank: over 60 s


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_forwarded_and_torn_down(tmp_path, sig):
    proc = _launcher(tmp_path, "report(); time.sleep(60)", "--nproc", "2")
    _wait_for([tmp_path / "rank0.json", tmp_path / "rank1.json"])
    info = _reports(tmp_path, 2)
    assert _leftovers(info[0]["COMMFUSE_RUN_ID"]) != []  # the network is up while it runs
    proc.send_signal(sig)
    assert proc.wait(timeout=15) == 128 + sig
    assert not any(_alive(i["pid"]) for i in info)
    assert _leftovers(info[0]["COMMFUSE_RUN_ID"]) == []


@needs_netns
def test_killed_launcher_is_cleaned_up_by_cleanup_stale(tmp_path):
    proc = _launcher(tmp_path, "report(); time.sleep(60)", "--nproc", "2")
    _wait_for([tmp_path / "rank0.json", tmp_path / "rank1.json"])
    info = _reports(tmp_path, 2)
    run_id = info[0]["COMMFUSE_RUN_ID"]
    proc.kill()  # no chance to tear down
    proc.wait()
    deadline = time.monotonic() + 5  # the ranks die with their launcher (PR_SET_PDEATHSIG)
    while any(_alive(i["pid"]) for i in info) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(i["pid"]) for i in info)
    assert _leftovers(run_id) != []
    assert run_id in cleanup_stale(verbose=False)
    assert _leftovers(run_id) == []


@needs_netns
def test_concurrent_runs_do_not_collide(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    procs = [_launcher(d, _ALL_REDUCE, "--nproc", "2", "--no-pin", "--timeout", "60")
             for d in dirs]
    assert [p.wait(timeout=90) for p in procs] == [0, 0]
    infos = [_reports(d, 2) for d in dirs]
    assert all(i["sum"] == [3.0] * 4 for info in infos for i in info)
    run_ids = {info[0]["COMMFUSE_RUN_ID"] for info in infos}
    assert len(run_ids) == 2 and all(_leftovers(r) == [] for r in run_ids)


def test_cpu_straggler_spec():
    spec = ClusterSpec(nproc=2, straggler_rank=1, straggler_cpu=0.5)
    assert spec.link_for(1) == spec.link and "rank 1: 0.5 of a core" in spec.describe()
    for bad in (0, 1.5, "half"):
        with pytest.raises(ValueError, match="straggler_cpu"):
            ClusterSpec(nproc=2, straggler_rank=1, straggler_cpu=bad)
    with pytest.raises(ValueError, match="together"):
        ClusterSpec(nproc=2, straggler_cpu=0.5)
    parser = add_launch_arguments(argparse.ArgumentParser())
    spec = spec_from_args(parser.parse_args("--straggler-rank 0 --straggler-cpu 0.25 -- x".split()))
    assert (spec.straggler_rank, spec.straggler_cpu, spec.straggler_link) == (0, 0.25, None)
    with pytest.raises(ValueError, match="need --straggler-rank"):
        spec_from_args(parser.parse_args("--straggler-cpu 0.25 -- x".split()))


_MATMULS = """\
import torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
t0, c0 = time.perf_counter(), time.process_time()
while time.perf_counter() - t0 < 1.0:
    a @ a
report(cpu=(time.process_time() - c0) / (time.perf_counter() - t0),
       cgroup=open(f"/proc/{os.getpid()}/cgroup").read())
"""


@needs_netns
@pytest.mark.skipif(not cluster_cpu.available(), reason="needs a cgroup cpu controller")
def test_cpu_straggler_runs_slower_and_its_cgroup_is_removed(tmp_path):
    spec = ClusterSpec(nproc=2, straggler_rank=1, straggler_cpu=0.4)
    assert launch(spec, _script(tmp_path, _MATMULS)) == 0
    fast, slow = _reports(tmp_path, 2)
    # the quota is a ceiling on the straggler's CPU per second of wall time (0.4 of a core,
    # plus a period's slack); a busy machine can only lower it, so this holds under load
    assert slow["cpu"] < 0.4 + 0.15, slow
    assert "commfuse-" in slow["cgroup"] and "commfuse-" not in fast["cgroup"]
    ours = f"commfuse-{os.getpid()}"  # the launcher's (this process's) cgroup; others may run
    assert not any(os.path.exists(f"{root}/{ours}") for root in ("/sys/fs/cgroup",
                                                                 "/sys/fs/cgroup/cpu")), ours

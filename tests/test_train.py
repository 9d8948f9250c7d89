"""The training job: parallel runs follow the single-process run step by step; resume is exact.

A small model (not the tiny preset) on the shipped corpus. The single-process reference runs
in this process; every 2-rank run shares one spawn (`_runs`), each building its own groups.
Ten steps: the losses of every step must match and fall (the same code runs at every step);
resume stops halfway through eight.
"""

import dataclasses
import functools
import os
import subprocess
import sys

import pytest

import probe_small
from commfuse import train
from commfuse.testbed.spawn import run_local

SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
# a preset and a given peak: no probe at the start of each of the many runs below (dp2-auto
# fits the model as a user's run does, with the smaller probe of tests/probe_small.py)
BASE = train.TrainConfig(steps=10, batch_size=4, seq_len=32, model=SMALL, progress=False,
                         exposed_iters=0, hardware="cpu-testbed", peak_flops=1e9)
LAYOUTS = {"tp2": dict(tp=2), "up2": dict(up=2), "dp2": dict(dp=2)}
RUNS = {f"{name}-{m}": dataclasses.replace(BASE, method=m, **kw)
        for name, kw in LAYOUTS.items() for m in ("commfuse", "none")}
RUNS.update({  # ZeRO-3 prefetch (on, one block ahead, above): off, two ahead, auto's methods
    "dp2-commfuse-pf0": dataclasses.replace(BASE, dp=2, prefetch=0),
    "dp2-sliced-pf2": dataclasses.replace(BASE, dp=2, method="sliced", prefetch=2),
    "dp2-auto": dataclasses.replace(BASE, dp=2, method="auto", hardware="measured")})
VARLEN = dataclasses.replace(BASE, steps=8, seq_len=31, variable_length=True)  # 16..31 tokens
VARLEN_RUNS = {f"{name}-varlen": dataclasses.replace(VARLEN, **kw)
               for name, kw in LAYOUTS.items() if name != "dp2"}
TIED = dataclasses.replace(BASE, steps=6, model={**SMALL, "tie_embeddings": True})
TIED_RUNS = {f"{name}-tied": dataclasses.replace(TIED, **kw) for name, kw in LAYOUTS.items()}
RESUME, STOP = 8, 4  # steps straight vs STOP + resume + the rest


def _runs(rank, world, configs, ckpt_root):
    probe_small.shrink()
    out = {name: [m["loss"] for m in train.train_rank(rank, world, cfg)]
           for name, cfg in configs.items()}
    for layout in ("tp2", "dp2"):
        d = os.path.join(ckpt_root, layout)
        cfg = dataclasses.replace(BASE, steps=RESUME, checkpoint_dir=d, **LAYOUTS[layout])
        out[f"{layout}-straight"] = [m["loss"] for m in
                                     train.train_rank(rank, world, dataclasses.replace(
                                         cfg, checkpoint_dir=None))]
        first = train.train_rank(rank, world, dataclasses.replace(cfg, stop_after=STOP))
        second = train.train_rank(rank, world, dataclasses.replace(cfg, resume=True))
        out[f"{layout}-resumed"] = [m["loss"] for m in first + second]
        out[f"{layout}-resumed-steps"] = [m["step"] for m in first + second]
    return out


@functools.lru_cache(maxsize=None)
def results(tmp: str) -> dict:
    return run_local(_runs, 2, {**RUNS, **VARLEN_RUNS, **TIED_RUNS}, tmp, timeout=300)[0]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def runs(ckpt_root):
    return results(ckpt_root)


@functools.lru_cache(maxsize=None)
def single_process(which: str) -> list[float]:
    """The losses of BASE, VARLEN or TIED (``which``) in this process, once each."""
    return [m["loss"] for m in train.launch({"base": BASE, "varlen": VARLEN, "tied": TIED}[which])]


@pytest.fixture(scope="module")
def reference():
    return single_process("base")


def _max_rel(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_parallel_run_matches_single_process(runs, reference, name):
    assert _max_rel(runs[name], reference) < 1e-4
    assert reference[-1] < reference[0] - 0.3  # it learns


@pytest.mark.parametrize("name", sorted(VARLEN_RUNS))
def test_variable_uneven_lengths_match_single_process(runs, name):
    """Odd lengths that change every step: uneven shards, a different split each step."""
    lengths = {train.seq_len_at(VARLEN, i) for i in range(VARLEN.steps)}
    assert len(lengths) > 3 and any(n % 2 for n in lengths)  # odd: uneven over 2 ranks
    assert _max_rel(runs[name], single_process("varlen")) < 1e-4


@pytest.mark.parametrize("name", sorted(TIED_RUNS))
def test_tied_embeddings_match_single_process(runs, name):
    """One weight for the embedding and the head: a vocabulary shard under TP/UP."""
    assert _max_rel(runs[name], single_process("tied")) < 1e-4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_commfuse_matches_none(runs, layout):
    assert _max_rel(runs[f"{layout}-commfuse"], runs[f"{layout}-none"]) < 1e-4


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_resume_is_exact(runs, layout):
    assert runs[f"{layout}-resumed-steps"] == list(range(1, RESUME + 1))
    assert runs[f"{layout}-resumed"] == runs[f"{layout}-straight"]


def test_checkpoint_layout(runs, ckpt_root):
    root = os.path.join(ckpt_root, "dp2")
    assert open(os.path.join(root, "latest")).read() == f"step-{RESUME:08d}"
    assert sorted(os.listdir(root)) == ["latest", f"step-{STOP:08d}", f"step-{RESUME:08d}"]


def test_resume_rejects_other_layout(tmp_path):
    cfg = dataclasses.replace(BASE, steps=2, checkpoint_dir=str(tmp_path))
    train.launch(cfg)
    with pytest.raises(ValueError, match="resharding is not supported"):
        train.launch(dataclasses.replace(cfg, resume=True, model={**SMALL, "n_layers": 1}))


def test_flags_and_defaults():
    import argparse

    p = argparse.ArgumentParser()
    train.add_arguments(p)
    cfg = train.config_from_args(p.parse_args([]))
    assert (cfg.tp, cfg.up, cfg.dp, cfg.method) == (2, 1, 1, "commfuse")
    cfg = train.config_from_args(p.parse_args(["--dp", "2", "--method", "sliced", "--chunks", "2"]))
    assert (cfg.tp, cfg.dp, cfg.method_opts()) == (1, 2, {"chunks": 2, "timeout": 60.0})
    with pytest.raises(SystemExit):
        train.config_from_args(p.parse_args(["--tp", "2", "--nproc", "3"]))


def test_runs_under_torchrun(tmp_path):
    out = tmp_path / "m.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "commfuse.train", "--up", "2", "--steps", "3", "--batch-size", "2",
           "--seq-len", "32", "--hardware", "cpu-testbed", "--metrics-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step    3/3" in proc.stdout
    import json

    metrics = json.loads(out.read_text())
    assert metrics["world"] == 2 and len(metrics["steps"]) == 3


def test_link_flag_chooses_where_local_ranks_run(monkeypatch):
    """--link: loopback / one rank / torchrun run here; auto without emulation falls back to
    loopback with a note; an explicit rate without emulation is refused, not ignored."""
    import argparse

    from commfuse.testbed import net
    from commfuse.train.command import on_emulated_cluster

    p = argparse.ArgumentParser()
    train.add_arguments(p)

    def where(*flags):
        args = p.parse_args(list(flags))
        return on_emulated_cluster(args, train.config_from_args(args))

    def unavailable():
        raise net.EmulationUnavailable("not root")

    monkeypatch.setattr(net, "check_available", unavailable)
    monkeypatch.delenv("RANK", raising=False)
    assert p.parse_args([]).link == "auto"
    assert where("--link", "loopback") is None
    assert where("--dp", "1", "--tp", "1", "--link", "200mbit") is None  # one rank: no network
    assert where() is None  # auto, emulation unavailable: loopback
    with pytest.raises(SystemExit, match="--link 200mbit: not root"):
        where("--link", "200mbit")
    monkeypatch.setenv("RANK", "0")
    assert where("--link", "200mbit") is None  # under torchrun: its ranks are already placed

"""``commfuse train``'s command line: what ``--help`` promises is what the flags do, and the
job's output is free of the warnings a missing dependency causes."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commfuse import train

ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    return p


@pytest.mark.parametrize("flags", [[], ["--tp", "2"], ["--up", "2", "--dp", "2"]])
def test_nproc_1_runs_one_unsharded_process(flags, capsys):
    p = _parser()
    assert "unsharded" in p.format_help()  # the help says what --nproc 1 does ...
    cfg = train.config_from_args(p.parse_args([*flags, "--nproc", "1"]))
    assert (cfg.tp, cfg.up, cfg.dp, cfg.world) == (1, 1, 1, 1)  # ... and it does it
    note = capsys.readouterr().err
    assert "--nproc 1: one unsharded process" in note and "ignoring tp=" in note


def test_nproc_that_disagrees_with_the_layout_is_refused():
    with pytest.raises(SystemExit, match="--nproc 3 != tp\\*up\\*dp = 2"):
        train.config_from_args(_parser().parse_args(["--tp", "2", "--nproc", "3"]))
    cfg = train.config_from_args(_parser().parse_args(["--dp", "2", "--nproc", "2"]))
    assert (cfg.tp, cfg.dp) == (1, 2)


def test_help_names_every_shipped_hf_config_and_what_train_trains(monkeypatch):
    """--hf-config's help lists commfuse/data/hf/ as it is; `commfuse --help` says train takes
    the presets and transformers configs."""
    from commfuse import cli
    from commfuse.data import DATA_DIR

    monkeypatch.setenv("COLUMNS", "2000")  # no line breaks inside a name
    shipped = sorted(p.stem for p in (DATA_DIR / "hf").glob("*.json"))
    assert len(shipped) >= 10
    assert f"Shipped: {', '.join(shipped)}." in _parser().format_help()
    top = cli.build_parser().format_help()
    assert "train a Llama preset, or a transformers config (--hf-config)" in top


def test_numpy_is_a_declared_dependency():
    """``import torch`` warns "Failed to initialize NumPy" without numpy (torch does not
    require it), so a fresh ``pip install -e .`` must bring it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps
    blocked = subprocess.run([sys.executable, "-c", "import sys; sys.modules['numpy'] = None; "
                              "import torch"], capture_output=True, text=True, timeout=120)
    assert "Failed to initialize NumPy" in blocked.stderr  # why: torch itself warns


def test_train_help_and_a_one_step_run_print_no_numpy_warning(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for args in (["train", "--help"],
                 ["train", "--nproc", "1", "--steps", "1", "--batch-size", "1", "--seq-len", "8",
                  "--peak-flops", "1e9", "--metrics-json", str(tmp_path / "m.json")]):
        proc = subprocess.run([sys.executable, "-m", "commfuse.cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Failed to initialize NumPy" not in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "m.json").is_file()


def _verdict(**kw):
    from commfuse.train.compare import Verdict
    return Verdict(**{**dict(method="commfuse", link="1gbit delay 0us", steps=60, step_s=0.30,
                             none_step_s=0.40, exposed_s=0.05, none_exposed_s=0.20,
                             none_fwd_bwd_s=0.35, max_loss_diff=0.004, loss_tol=0.05), **kw})


def test_verdict_says_what_the_ratio_means():
    """Each case of the verdict line, from the figures it is given (no processes)."""
    fast = _verdict().line()
    assert "0.75x of none (25 % less time per step)" in fast
    assert "75 % of the communication none leaves exposed hidden (200 ms -> 50 ms" in fast
    assert "losses equal within 0.004 over 60 steps" in fast
    assert "no gain beyond the 3 %" in _verdict(step_s=0.39).line()
    assert "1.10x of none (10 % MORE time per step): slower" in _verdict(step_s=0.44).line()
    assert "little to hide" in _verdict(none_exposed_s=0.02, exposed_s=0.01).line()
    assert "exposed more communication than none" in _verdict(exposed_s=0.3).line()
    assert "losses DIFFER by up to 0.3" in _verdict(max_loss_diff=0.3).line()
    assert "loopback, which cannot show overlap" in _verdict(link="loopback").line()
    assert "hidden" not in _verdict(link="loopback").line()


def test_compare_none_prints_and_records_the_verdict_of_the_run(tmp_path, capsys):
    """A cheap 2-rank --compare-none on loopback: the verdict line is printed, says loopback
    shows no overlap, and --metrics-json holds it as fields computed from the run's steps."""
    import json
    import statistics
    out = tmp_path / "m.json"
    args = _parser().parse_args(["--compare-none", "--link", "loopback", "--steps", "3",
                                 "--batch-size", "2", "--seq-len", "16", "--hardware",
                                 "cpu-testbed", "--peak-flops", "1e9",
                                 "--metrics-json", str(out)])
    assert train.run(args) == 0
    data = json.loads(out.read_text())
    v = data["compare_none"]
    assert v["step_s"] == statistics.median(m["step_s"] for m in data["steps"][1:])
    assert len(v["step_ratios"]) == 2  # paired: each step after the first, against none's
    assert v["ratio"] == statistics.median(v["step_ratios"]) and v["loopback"] and v["steps"] == 3
    assert v["exposed_s"] == data["summary"]["exposed_comm_s"]
    assert v["losses_equal"] and v["max_loss_diff"] < 1e-3
    printed = capsys.readouterr().out
    assert v["line"] in printed.splitlines()
    assert v["line"].startswith(f"verdict: commfuse step {v['ratio']:.2f}x of none on loopback, "
                                "which cannot show overlap")


def test_paired_ratio_is_each_steps_ratio_not_the_ratio_of_medians():
    """The machine slows down through the run: paired steps (`paired_rank`) see the slowdown on
    both sides and keep the 0.8 every step shows; sequential runs compare medians."""
    from types import SimpleNamespace

    from commfuse.train.compare import verdict
    slow = [1.0, 1.0, 1.5, 2.0, 2.5, 3.0]  # none's step times, drifting up
    base = [{"step_s": t, "loss": 1.0} for t in slow]
    first = [{"step_s": 0.8 * t, "loss": 1.0} for t in slow]
    cfg = SimpleNamespace(method="auto", dtype="float32")
    v = verdict(cfg, first, base, "1gbit", paired=True)
    assert v.step_ratios == pytest.approx([0.8] * 5) and v.ratio == pytest.approx(0.8)
    # the method's run first, none's after it on a slower machine: medians mislead
    seq = verdict(cfg, first, [{"step_s": 1.5 * t, "loss": 1.0} for t in slow], "1gbit")
    assert seq.step_ratios is None and seq.ratio == pytest.approx(0.8 / 1.5)
    assert verdict(cfg, first[:1], base[:1], "1gbit", paired=True).ratio == pytest.approx(0.8)


def test_only_methods_that_consult_the_cost_model_fit_it():
    """The seconds-long hardware fit runs for auto and commfuse without --splits only (what
    `commfuse.ops.auto` is asked by), so --compare-none's none run skips it."""
    fits = {m: train.TrainConfig(method=m).consults_cost_model
            for m in ("auto", "commfuse", "none", "sliced", "decompose")}
    assert fits == {"auto": True, "commfuse": True, "none": False, "sliced": False,
                    "decompose": False}
    assert not train.TrainConfig(method="commfuse", splits=2).consults_cost_model

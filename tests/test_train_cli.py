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

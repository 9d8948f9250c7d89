"""Each ``examples/*.py`` runs as its docstring says (``python examples/X.py``: 2 local gloo
ranks) and ends with what it promises: the checks inside the examples (TP losses equal one
process's, TP greedy tokens equal one process's) fail the run if they fail."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_every_example_is_tested_and_says_how_to_run_it():
    names = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert names == ["generate.py", "tp_own_module.py", "tp_transformers.py"]
    for name in names:
        doc = (EXAMPLES / name).read_text().split('"""')[1]
        assert f"python examples/{name}" in doc and f"torchrun --nproc-per-node 2 examples/{name}" in doc


def test_tp_own_module_losses_equal_one_process():
    out = _run("tp_own_module.py")
    assert "losses equal one process's" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+\d", line)]
    assert len(rows) == 6 and float(rows[-1][1]) < float(rows[0][1])  # it learned something


def test_tp_transformers_losses_equal_one_process():
    pytest.importorskip("transformers")
    out = _run("tp_transformers.py")
    assert "losses equal one process's" in out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, out


def test_generate_prints_text_equal_to_one_process():
    out = _run("generate.py")
    assert out.startswith("ROMEO:") and "the same 24 tokens as one process" in out

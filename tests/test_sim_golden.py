"""`commfuse plan --json` and `commfuse simulate` give the numbers recorded in
tests/data/sim_golden.json: the shipped model and hardware presets and transformers configs.

A change that moves a prediction on purpose records the file again:

    .venv/bin/python tests/test_sim_golden.py --record
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "data" / "sim_golden.json"

SMALL = ["--hw", "cpu-testbed", "--inter-hw", "same", "--seq", "256"]
PLANS = {  # name -> `commfuse plan` arguments (--json and --no-files added)
    **{m: ["--model", m, "--devices", "8", "--methods", "none,commfuse,auto"]
       for m in ("1b", "7b", "8b", "13b", "70b", "mixtral-8x7b", "qwen3-30b-a3b",
                 "deepseek-v2-lite", "nemotron-h-8b")},
    **{m: ["--model", m, "--devices", "4", *SMALL] for m in ("tiny", "small")},
    "70b-ops-only": ["--model", "70b", "--devices", "64", "--ops-only"],
    "7b-previous": ["--model", "7b", "--devices", "16", "--ops-only", "--step", "previous",
                    "--methods", "none,decompose,commfuse", "--splits", "2"],
    "8b-zero3": ["--model", "8b", "--devices", "8", "--hw", "h100-hbm2e-500w", "--seq", "8192",
                 "--local-batch", "2", "--ac", "full", "--sharding", "commfuse",
                 "--methods", "none,sliced"],
    "mixtral-ep": ["--model", "mixtral-8x7b", "--devices", "16", "--local-batch", "2",
                   "--micro-batch", "1", "--layout", "2,1,8,tp", "--methods", "none,commfuse"],
    **{f"hf-{n}": ["--hf-config", n, "--devices", "4", *SMALL]
       for n in ("llama-tiny", "mixtral-tiny", "qwen3-moe-tiny", "bamba-tiny",
                 "nemotron-h-tiny")},
}
SIMULATES = {  # name -> `commfuse simulate` arguments
    **{f"mlp-{hw}": ["--hw", hw] for hw in (
        "a100-nvlink", "ascend910b-hccs", "cpu-testbed", "h100-hbm2e-500w", "h100-nvlink",
        "h200-nvlink", "multinode-100g", "pcie-node")},
    "ag_matmul-8": ["--op", "ag_matmul", "--world", "8", "--shape", "65536,4096,4096"],
    "matmul_rs-cpu": ["--op", "matmul_rs", "--world", "2", "--shape", "4096,1024,1024",
                      "--hw", "cpu-testbed", "--dtype-bytes", "4"],
    "a2a_matmul": ["--op", "a2a_matmul", "--world", "4", "--shape", "16384,4096,4096"],
    "table1": ["--table1"],
}


TOP = 2  # plans kept whole per case; the rest as a digest


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.9g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _plan(args: list[str], tmp: Path) -> dict:
    """The best plans' records whole, and every record's digest (floats to 9 digits)."""
    from commfuse.cli import main

    out = tmp / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", *args, "--json", str(out), "--no-files"]) == 0
    records = json.loads(out.read_text())
    every = json.dumps(_rounded(records), sort_keys=True).encode()
    return {"plans": len(records), "top": records[:TOP],
            "sha256": hashlib.sha256(every).hexdigest()}


def _simulate(args: list[str]) -> list[str]:
    from commfuse.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["simulate", *args]) == 0
    return buf.getvalue().splitlines()


def _close(got, want, where: str):
    """Equal, floats to 1e-9 relative (the last bits of a sum may differ between machines)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), where
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_the_golden_file_covers_the_cases(golden):
    assert sorted(golden["plan"]) == sorted(PLANS)
    assert sorted(golden["simulate"]) == sorted(SIMULATES)
    assert GOLDEN.stat().st_size < 50_000


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_json_is_unchanged(name, golden, tmp_path):
    _close(_plan(PLANS[name], tmp_path), golden["plan"][name], name)


@pytest.mark.parametrize("name", sorted(SIMULATES))
def test_simulate_output_is_unchanged(name, golden):
    assert _simulate(SIMULATES[name]) == golden["simulate"][name]


def _record(tmp: Path) -> dict:
    return {"plan": {n: _plan(a, tmp) for n, a in PLANS.items()},
            "simulate": {n: _simulate(a) for n, a in SIMULATES.items()}}


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        data = _record(Path(d))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}: {GOLDEN.stat().st_size} bytes")

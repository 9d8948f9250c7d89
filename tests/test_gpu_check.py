"""``commfuse check-gpu`` on a machine without a GPU: it imports, its --help is a manual, it
runs end to end with the loopback on CPU virtual ranks and every GPU check marked NOT RUN
(never passed), and ``--require-gpu`` says "no CUDA device" and exits with status 2. The GPU
checks themselves (`commfuse.check_gpu.perf`, `checks`) have not run here: only their pure
helpers are tested."""

import json
import sys

import pytest
import torch

from commfuse.check_gpu import CHECKS, CPU_CHECKS, main, table

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_help_lists_the_checks(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for name in (*CHECKS, "TORCH_CUDA_SANITIZER", "--require-gpu", "NOT RUN"):
        assert name in out


@no_cuda
def test_require_gpu_without_cuda_says_so_and_exits_2(capsys):
    assert main(["--only", "split_gemm", "--require-gpu"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err


@no_cuda
def test_without_cuda_the_loopback_runs_on_cpu_and_gpu_checks_are_not_run(command, tmp_path):
    """The whole command, as CI runs it: exit 0, the loopback PASS on cpu, every other check
    NOT RUN, the JSON report and the table."""
    r = command("check-gpu", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "check_gpu.json").read_text())
    assert report["device"] == "cpu" and list(report["checks"]) == list(CHECKS)
    for name, c in report["checks"].items():
        want = "PASS" if name in CPU_CHECKS else "NOT RUN"
        assert (c["status"], c["device"]) == (want, "cpu"), (name, c)
    assert report["loopback_failures"] == {} and report["loopback_cases"] == 3 * 4 * 11
    assert "NOT RUN" in r.stdout and "GPU checks NOT RUN" in r.stdout


@no_cuda
def test_python_m_runs_it(monkeypatch, capfd):
    """``python -m commfuse.check_gpu``, run in this process as the interpreter runs it."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["python -m commfuse.check_gpu", "--only", "loopback",
                                      "--require-gpu"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("commfuse.check_gpu", run_name="__main__")
    assert exit.value.code == 2 and "no CUDA device" in capfd.readouterr().err


def test_every_check_is_defined():
    from commfuse.check_gpu import _check

    assert all(callable(_check(name)) for name in CHECKS)


def test_overlap_fraction():
    from commfuse.check_gpu.perf import overlap_fraction

    assert overlap_fraction(10.0, 4.0, 10.0) == 1.0  # the transfer fully hidden
    assert overlap_fraction(10.0, 4.0, 14.0) == 0.0  # one after the other
    assert overlap_fraction(10.0, 4.0, 12.0) == pytest.approx(0.5)
    assert overlap_fraction(10.0, 4.0, 16.0) == 0.0 and overlap_fraction(0.0, 4.0, 4.0) == 0.0


def test_table_shows_every_status():
    report = {"checks": {"loopback": {"status": "PASS", "device": "cpu", "seconds": 3.0},
                         "overlap": {"status": "NOT RUN", "device": "cpu", "seconds": 0.0}}}
    lines = table(report).splitlines()
    assert lines[0].split() == ["check", "status", "device", "seconds"]
    assert "PASS" in lines[1] and "NOT RUN" in lines[2]

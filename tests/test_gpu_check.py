"""``commfuse check-gpu`` on a machine without a GPU: it imports, its --help is a manual, and it
says "no CUDA device" and exits with status 2 (the checks themselves need a GPU)."""

import sys

import pytest
import torch

from commfuse.check_gpu import CHECKS, main


def test_help_lists_the_checks(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for name in (*CHECKS, "TORCH_CUDA_SANITIZER"):
        assert name in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert main(["--only", "split_gemm"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_subcommand_and_python_m_run_it(command, monkeypatch, capfd):
    """``commfuse check-gpu`` and ``python -m commfuse.check_gpu``, run in this process as
    the interpreter runs them (the module as ``__main__``)."""
    import runpy

    r = command("check-gpu", "--only", "loopback")
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr
    monkeypatch.setattr(sys, "argv", ["python -m commfuse.check_gpu", "--only", "loopback"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("commfuse.check_gpu", run_name="__main__")
    assert exit.value.code == 2 and "no CUDA device" in capfd.readouterr().err


def test_every_check_is_defined():
    from commfuse.check_gpu import _check

    assert all(callable(_check(name)) for name in CHECKS)

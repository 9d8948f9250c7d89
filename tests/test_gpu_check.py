"""scripts/gpu_check.py on a machine without a GPU: it imports, its --help is a manual, and it
says "no CUDA device" and exits with status 2 (the checks themselves need a GPU)."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_check.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120)


def test_help_lists_the_checks():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for name in ("loopback", "single_rank", "train", "nccl", "split_gemm", "TORCH_CUDA_SANITIZER"):
        assert name in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    r = _run("--only", "split_gemm")
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr

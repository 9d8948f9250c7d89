"""``commfuse train --device cuda``: checked on the host before any rank starts (the CUDA run
itself is in `commfuse check-gpu`)."""

import pytest
import torch

from commfuse.train.__main__ import main
from commfuse.train.config import TrainConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_unavailable_is_a_clear_error(capsys):
    assert main(["--device", "cuda", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err and "Traceback" not in err


def test_fewer_gpus_than_ranks_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["--device", "cuda", "--tp", "2", "--steps", "1"]) == 2
    assert "2 local ranks need one GPU each, 1 visible" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")  # under torchrun: this node's ranks count
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert TrainConfig(tp=4, device="cuda").device_error(2) is not None
    assert TrainConfig(tp=4, device="cuda").device_error(1) is None
    assert TrainConfig(tp=4, device="cpu").device_error(8) is None


def test_device_choices_and_help(capsys):
    with pytest.raises(ValueError, match="device must be one of"):
        TrainConfig(device="tpu")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--device {cpu,cuda}" in capsys.readouterr().out

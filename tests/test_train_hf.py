"""``commfuse train --hf-config``: a transformers model from a shipped config, trained with
commfuse.tp, against the same model in one process."""

import pytest

from commfuse.train.config import TrainConfig
from commfuse.train.loop import launch

BASE = dict(hf_config="llama-tiny", steps=4, seq_len=15, batch_size=2, progress=False,
            peak_flops=1e9, exposed_iters=0, method="commfuse", hardware="cpu-testbed")


def _losses(**kw) -> list[float]:
    return [m["loss"] for m in launch(TrainConfig(**{**BASE, **kw}))]


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_tp2_matches_one_process(name):
    one, two = _losses(hf_config=name, tp=1), _losses(hf_config=name, tp=2)
    assert len(one) == len(two) == 4 and one[-1] < one[0]
    assert max(abs(a - b) / b for a, b in zip(two, one)) < 1e-4, (two, one)


@pytest.mark.parametrize("kw,match", [
    (dict(tp=1, up=2), "does not take --up"),
    (dict(tp=2, resume=True, checkpoint_dir="x"), "does not take --resume"),
    (dict(tp=1, dp=2, batch_size=3), r"global batch size \(3\)"),
])
def test_rejects(kw, match):
    from commfuse.train.hf import _check, load_config
    with pytest.raises(ValueError, match=match):
        _check(TrainConfig(**{**BASE, **kw}), load_config("llama-tiny"))

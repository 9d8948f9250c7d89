"""``commfuse train --hf-config``: a transformers model from a shipped config, trained with
commfuse.tp, against the same model in one process."""

import pytest

from commfuse.train.config import TrainConfig
from commfuse.train.loop import launch

BASE = dict(hf_config="llama-tiny", steps=4, seq_len=15, batch_size=2, progress=False,
            peak_flops=1e9, exposed_iters=0, method="commfuse", hardware="cpu-testbed")


def _losses(**kw) -> list[float]:
    return [m["loss"] for m in launch(TrainConfig(**{**BASE, **kw}))]


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "gemma3-tiny", "qwen3.5-tiny"])
def test_tp2_matches_one_process(name):
    """BASE's 4 steps: each step's loss equal to one process's, and falling."""
    one = _losses(hf_config=name, tp=1)
    two = _losses(hf_config=name, tp=2)
    assert len(one) == len(two) == BASE["steps"] and one[-1] < one[0]
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


def test_checkpoint_is_the_models_layout(tmp_path):
    """``--checkpoint-dir`` after one step on 2 ranks saves what one process saves: Phi-3's
    packed q|k|v and gate|up (held as each rank's whole heads) in the model's row order, and
    a tied embedding once (no lm_head.weight), which transformers loads back tied."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from commfuse.tp.families import tiny_config
    phi3 = tmp_path / "phi3.json"
    cfg = tiny_config("phi3", vocab_size=4096, hidden_size=64, max_position_embeddings=64)
    phi3.write_text(json.dumps(cfg.to_dict()))
    for name in (str(phi3), "qwen3-tied-tiny"):
        runs = {}
        for tp in (1, 2):
            root = tmp_path / f"{tp}-{len(name)}"
            launch(TrainConfig(**{**BASE, "hf_config": name, "tp": tp, "steps": 1,
                                  "checkpoint_dir": str(root)}))
            runs[tp] = load_file(root / "step-00000001" / "model.safetensors")
        assert runs[1].keys() == runs[2].keys()
        for key, want in runs[1].items():
            # AdamW's first step, lr g / (|g| + eps), magnifies another summation order's
            # difference where g is near eps (2e-4 seen); rows out of order differ by ~0.1
            assert (runs[2][key] - want).abs().max() < 2e-3, (name, key)
    assert "lm_head.weight" not in runs[2]
    model = AutoModelForCausalLM.from_pretrained(root / "step-00000001")
    assert model.lm_head.weight is model.get_input_embeddings().weight

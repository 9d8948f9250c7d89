"""``commfuse train --hf-config mixtral-tiny|qwen3-moe-tiny|gpt-oss-tiny --ep 2``: experts split over the
tp ranks, the loss with the router's auxiliary loss, against the same model in one process;
``--ep``'s validation and the MoE FLOP count."""

import argparse

import pytest

from commfuse.train.config import TrainConfig, add_arguments, config_from_args
from commfuse.train.loop import launch

BASE = dict(hf_config="mixtral-tiny", steps=3, seq_len=15, batch_size=2, progress=False,
            peak_flops=1e9, exposed_iters=0, method="commfuse", hardware="cpu-testbed")


def _losses(**kw) -> list[float]:
    return [m["loss"] for m in launch(TrainConfig(**{**BASE, **kw}))]


@pytest.mark.parametrize("name,steps", [("mixtral-tiny", 3), ("qwen3-moe-tiny", 3),
                                        ("gpt-oss-tiny", 6), ("deepseek-v3-tiny", 6)])
def test_ep2_matches_one_process(name, steps):
    one = _losses(hf_config=name, tp=1, steps=steps)
    two = _losses(hf_config=name, tp=2, ep=2, steps=steps)
    assert len(one) == len(two) == steps and one[-1] < one[0]
    assert max(abs(a - b) / b for a, b in zip(two, one)) < 1e-4, (two, one)


def test_ep_from_dp_trains_as_data_parallel():
    """--dp 2 --ep 2: the experts split over the two data-parallel ranks (left out of FSDP2),
    6 steps with the losses of --dp 2 alone (every expert on each rank, sharded by FSDP2)."""
    kw = dict(hf_config="gpt-oss-tiny", dp=2, steps=6)
    split, whole = _losses(**kw, ep=2), _losses(**kw)
    assert len(split) == 6 and split[-1] < split[0]
    assert max(abs(a - b) / b for a, b in zip(split, whole)) < 1e-4, (split, whole)


def test_loss_includes_the_aux_loss():
    """The shipped configs record router logits: the loss is CE + coef * aux (> CE alone)."""
    import torch
    import torch.nn.functional as F
    from commfuse.train.hf import build
    model, _ = build(TrainConfig(**{**BASE, "tp": 1}), 1)
    ids = torch.randint(4096, (2, 15), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert out.aux_loss is not None and out.aux_loss > 0
    assert torch.allclose(out.loss, ce + model.config.router_aux_loss_coef * out.aux_loss)


def _parse(*argv) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_ep_flag_sets_tp_and_is_checked():
    assert _parse("--hf-config", "mixtral-tiny", "--ep", "2").tp == 2
    from_dp = _parse("--hf-config", "mixtral-tiny", "--ep", "2", "--dp", "2")
    assert (from_dp.tp, from_dp.world) == (1, 2)
    assert _parse("--hf-config", "mixtral-tiny", "--ep", "4", "--tp", "2", "--dp", "2").world == 4
    with pytest.raises(SystemExit, match="must be a multiple of --tp 4"):
        _parse("--hf-config", "mixtral-tiny", "--ep", "2", "--tp", "4")
    with pytest.raises(SystemExit, match="divides tp\\*dp = 4"):
        _parse("--hf-config", "mixtral-tiny", "--ep", "8", "--tp", "2", "--dp", "2")
    with pytest.raises(ValueError, match="built-in Llama has no experts"):
        TrainConfig(ep=2)
    with pytest.raises(ValueError, match="positive int"):
        TrainConfig(hf_config="mixtral-tiny", ep=0)


@pytest.mark.parametrize("kw,name,match", [
    (dict(tp=2, ep=2), "llama-tiny", "needs a mixture-of-experts config"),
    (dict(tp=4, ep=2), "mixtral-tiny", r"--ep \(2\) must be a multiple of --tp \(4\)"),
])
def test_rejects(kw, name, match):
    from commfuse.train.hf import _check, load_config
    with pytest.raises(ValueError, match=match):
        _check(TrainConfig(**{**BASE, "hf_config": name, **kw}), load_config(name))


def test_flops_count_the_active_experts():
    """6N counts the router and k of the E experts per MoE layer, not all E."""
    from commfuse.train.hf import load_config
    from commfuse.train.hf_flops import matmul_weights
    for name, f in (("mixtral-tiny", "intermediate_size"), ("qwen3-moe-tiny", "moe_intermediate_size")):
        hf = load_config(name)
        d, q, H, G = hf.hidden_size, hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads
        layer = d * q * (2 * H + 2 * G) + d * 8 + 3 * d * getattr(hf, f) * 2
        assert matmul_weights(hf) == d * hf.vocab_size + hf.num_hidden_layers * layer, name


def test_router_losses_and_capacity_flags():
    """--moe-seq-aux-coef / --moe-z-loss-coef on tp 2: the losses of one process (the terms
    completed over the TP group), the terms logged; --moe-capacity-factor logs the dropped
    fraction (none at factor 8: the drops themselves are tests/test_moe_balance.py's)."""
    kw = dict(moe_seq_aux_coef=0.5, moe_z_loss_coef=0.05, steps=2)
    one = launch(TrainConfig(**{**BASE, **kw, "tp": 1}))
    two = launch(TrainConfig(**{**BASE, **kw, "tp": 2, "moe_capacity_factor": 8.0}))
    for a, b in zip(two, one):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-4, (two, one)
        assert a["moe"]["seq_aux"] > 0 and a["moe"]["z"] > 0
        assert abs(a["moe"]["z"] - b["moe"]["z"]) / b["moe"]["z"] < 1e-4
    assert [m["moe"]["dropped"] for m in two] == [0.0, 0.0]  # factor 8: room for every row
    with pytest.raises(ValueError, match="--moe-capacity-factor takes a finite number > 0"):
        TrainConfig(**{**BASE, "moe_capacity_factor": 0.0})
    with pytest.raises(ValueError, match="--moe-z-loss-coef takes a finite number >= 0"):
        TrainConfig(**{**BASE, "moe_z_loss_coef": -1.0})

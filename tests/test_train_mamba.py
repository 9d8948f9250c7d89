"""``commfuse train --hf-config`` on the shipped Mamba-2 and hybrid configs (mamba2-tiny,
bamba-tiny, nemotron-h-tiny, nemotron-h-moe-tiny): two steps on 2 TP ranks (and 2 x 2 with FSDP2) give one
process's losses under each method; the MFU numerator counts each architecture's weights."""

import pytest
import torch

from commfuse.train.config import TrainConfig
from commfuse.train.loop import launch

# 130 tokens: 3 scan chunks of 64 (the last one short), split 65/65 over 2 ranks
BASE = dict(steps=2, seq_len=130, batch_size=2, progress=False, peak_flops=1e9,
            exposed_iters=0, hardware="cpu-testbed")


def _losses(**kw) -> list[float]:
    return [m["loss"] for m in launch(TrainConfig(**{**BASE, **kw}))]


def _close(got, want) -> bool:
    return len(got) == len(want) and max(abs(a - b) / b for a, b in zip(got, want)) < 1e-4


# bamba-tiny trains through the same code as nemotron-h-tiny (test_tp_mamba checks Bamba's plan)
@pytest.mark.parametrize("name,runs", [
    ("mamba2-tiny", [dict(tp=2, method="none"), dict(tp=2, method="commfuse"),
                     dict(tp=2, dp=2, method="auto")]),
    ("nemotron-h-tiny", [dict(tp=2, method="auto")]),
    ("nemotron-h-moe-tiny", [dict(tp=2, ep=2, method="commfuse")]),  # experts over the 2 ranks
])
def test_tp_matches_one_process(name, runs):
    one = _losses(hf_config=name, tp=1)
    assert one[-1] < one[0], one
    for kw in runs:
        got = _losses(hf_config=name, **kw)
        assert _close(got, one), (kw, got, one)


# --- no processes: the FLOPs per token ------------------------------------------------------

def _model(name: str, **over):
    from transformers import AutoModelForCausalLM

    from commfuse.train.hf import load_config
    cfg = load_config(name)
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return cfg, AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", ["mamba2-tiny", "bamba-tiny", "nemotron-h-tiny", "llama-tiny"])
def test_matmul_weights_are_the_models_matrices(name):
    """N is every weight matrix (conv1d's too) but the embedding, as the model holds them."""
    from commfuse.train.hf_flops import matmul_weights
    cfg, model = _model(name)
    want = sum(p.numel() for n, p in model.named_parameters()
               if p.dim() >= 2 and "embed" not in n)
    assert matmul_weights(cfg) == want


def test_moe_counts_the_active_experts():
    """A Nemotron-H MoE layer: the router, k of E routed experts and the shared expert."""
    from commfuse.train.hf_flops import matmul_weights
    cfg, model = _model("nemotron-h-tiny", layers_block_type=["linear_attention", "moe"],
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        moe_shared_expert_intermediate_size=48)
    k_of_e = cfg.num_experts_per_tok / cfg.n_routed_experts
    want = sum(p.numel() * (k_of_e if ".experts." in n else 1)
               for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n)
    assert matmul_weights(cfg) == want


def test_flops_per_token_terms():
    """Llama: PaLM's 6N + 12 L H q T; Mamba-2: 6N + the SSD scan per layer, its chunk at most
    the sequence."""
    from commfuse.train.hf import load_config
    from commfuse.train.hf_flops import flops_per_token, matmul_weights
    llama = load_config("llama-tiny")
    q = llama.hidden_size // llama.num_attention_heads
    assert flops_per_token(llama, 100) == 6 * matmul_weights(llama) + 12 * 2 * 4 * q * 100
    m = load_config("mamba2-tiny")  # 2 layers, H 8, P 32, N 32, chunk 64
    for T, Q in ((1024, 64), (16, 16)):
        scan = 6 * 8 * (Q * (32 + 32) + 2 * 32 * 32)
        assert flops_per_token(m, T) == 6 * matmul_weights(m) + 2 * scan


def test_checkpoint_is_the_models_layout(tmp_path):
    """``--checkpoint-dir`` after one step on 2 ranks saves what one process saves: in_proj /
    conv1d (held as each rank's z|x|B|C|dt rows, assembled) back in the model's row order."""
    from safetensors.torch import load_file
    runs = {}
    for tp in (1, 2):
        launch(TrainConfig(**{**BASE, "hf_config": "mamba2-tiny", "tp": tp, "steps": 1,
                              "method": "commfuse",
                              "checkpoint_dir": str(tmp_path / f"tp{tp}")}))
        runs[tp] = load_file(tmp_path / f"tp{tp}" / "step-00000001" / "model.safetensors")
    assert runs[1].keys() == runs[2].keys()
    for name, want in runs[1].items():
        assert runs[2][name].shape == want.shape, name
        # AdamW's first step, lr g / (|g| + eps), magnifies another summation order's
        # difference where g is near eps (1e-5 seen); rows out of order differ by ~0.1
        assert (runs[2][name] - want).abs().max() < 1e-4, name

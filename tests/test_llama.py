"""The plain-PyTorch Llama: config validation, shapes, parameter/FLOP counts, a short training run,
and weight-for-weight agreement with Hugging Face transformers' LlamaForCausalLM."""

import copy
import dataclasses

import pytest
import torch

from commfuse.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    RopeScaling,
    flops_per_token,
    from_hf,
    matmul_params,
    num_params,
    rope_inv_freq,
    to_hf,
)


def small_cfg(**kw):
    return LlamaConfig(**{**dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 ffn_hidden=96, max_seq_len=32), **kw})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid(name):
    cfg = LlamaConfig.preset(name)
    assert cfg.dim % cfg.n_heads == 0 and cfg.n_heads % cfg.n_kv_heads == 0
    assert LlamaConfig.preset(name, n_layers=1).n_layers == 1


def test_tiny_preset_matches_tokenizer_vocab():
    from commfuse.data import VOCAB_SIZE

    assert LlamaConfig.preset("tiny").vocab_size == VOCAB_SIZE


def test_real_preset_sizes():
    # Published parameter counts: Llama 2 7B, Llama 3 8B, Llama 3 70B, Llama 3.2 1B.
    assert num_params(LlamaConfig.preset("7b")) == 6_738_415_616
    assert num_params(LlamaConfig.preset("8b")) == 8_030_261_248
    assert num_params(LlamaConfig.preset("70b")) == 70_553_706_496
    assert num_params(LlamaConfig.preset("1b")) == 1_235_814_400


def test_meta_device_build_of_a_real_size():
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("7b", n_layers=2))
    assert sum(p.numel() for p in model.parameters()) == num_params(model.cfg)


def test_meta_build_then_materialize_keeps_tied_weights():
    with torch.device("meta"):
        model = Llama(small_cfg(tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.output.weight is model.tok_emb.weight
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert model.layers[0].attn.wo.weight.std() < model.layers[0].attn.wq.weight.std()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dim=65), "not divisible by n_heads"),
        (dict(n_kv_heads=3), "must divide n_heads"),
        (dict(n_layers=0), "n_layers must be a positive int"),
        (dict(vocab_size=1.5), "vocab_size must be a positive int"),
        (dict(norm_eps=0.0), "norm_eps must be > 0"),
        (dict(rope_theta=-1.0), "rope_theta must be > 0"),
        (dict(dim=12, n_heads=4), "head_dim=3 must be even"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        small_cfg(**kw)


def test_config_defaults_and_unknown_preset():
    cfg = LlamaConfig(dim=4096, n_heads=32)
    assert cfg.n_kv_heads == 32 and cfg.ffn_hidden == 11008  # Llama's 8/3 rule, multiple of 256
    with pytest.raises(ValueError, match="unknown preset"):
        LlamaConfig.preset("13b")


@pytest.mark.parametrize("tie", [False, True])
def test_shapes_names_and_param_count(tie):
    cfg = small_cfg(tie_embeddings=tie)
    model = Llama(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (3, 17)))
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    assert (model.output.weight is model.tok_emb.weight) == tie
    names = dict(model.named_modules())
    for n in ("tok_emb", "norm", "output", "layers.1.attn_norm", "layers.1.mlp_norm",
              "layers.1.attn.wq", "layers.1.attn.wk", "layers.1.attn.wv", "layers.1.attn.wo",
              "layers.1.mlp.w_gate", "layers.1.mlp.w_up", "layers.1.mlp.w_down"):
        assert n in names
    assert model.layers[0].attn.wk.weight.shape == (cfg.n_kv_heads * cfg.head_dim, cfg.dim)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_causal():
    torch.manual_seed(0)
    model = Llama(small_cfg())
    tokens = torch.randint(0, 97, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 97
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])


def test_flops_per_token():
    cfg = LlamaConfig.preset("7b")
    n = matmul_params(cfg)
    assert n == num_params(cfg) - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    assert flops_per_token(cfg, 4096) == 6 * n + 12 * 32 * 32 * 128 * 4096


def test_tiny_preset_loss_decreases():
    torch.manual_seed(0)
    cfg = LlamaConfig.preset("tiny")
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, cfg.vocab_size, (4, 65))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(15):  # one batch, memorised: the loss halves by step 13
        loss = model.loss(inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5
    assert losses[-1] < 0.5 * losses[0], losses


# --- Hugging Face interop --------------------------------------------------------------------


def hf_model(tie=False, **kw):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        **{**dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tie), **kw})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random norm gains too, so that a swapped norm would show
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.05)
            if p.dim() == 1:
                p.add_(1.0)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_matches_logits(tie):
    hf = hf_model(tie)
    ours = from_hf(hf).eval()
    assert ours.cfg.tie_embeddings == tie and ours.cfg.rope_theta == 500000.0
    tokens = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
    # The weights are copies: changing ours leaves the HF model as it was.
    with torch.no_grad():
        ours.layers[0].attn.wq.weight.zero_()
    assert hf.model.layers[0].self_attn.q_proj.weight.abs().sum() > 0


def test_from_hf_state_dict_needs_config():
    hf = hf_model()
    with pytest.raises(ValueError, match="needs hf_config"):
        from_hf(hf.state_dict())
    ours = from_hf(hf.state_dict(), hf.config)
    tokens = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)


def test_from_hf_rejects_unsupported():
    hf = hf_model()
    config = copy.deepcopy(hf.config)
    config.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias"):
        from_hf(hf.state_dict(), config)
    sd = hf.state_dict()
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        from_hf(sd, hf.config)


@pytest.mark.parametrize("tie", [False, True])
def test_to_hf_matches_logits(tie):
    pytest.importorskip("transformers")
    torch.manual_seed(1)
    ours = Llama(small_cfg(tie_embeddings=tie, rope_theta=10000.0)).eval()
    with torch.no_grad():
        for layer in ours.layers:
            layer.attn_norm.weight.uniform_(0.5, 1.5)
            layer.mlp_norm.weight.uniform_(0.5, 1.5)
    hf = to_hf(ours)
    tokens = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)
    back = from_hf(hf)
    assert back.cfg == ours.cfg
    for (name, p), (name2, q) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert name == name2 and torch.equal(p, q)


# Llama 3.1's rope_scaling, at a short original context so that 40 tokens feel it
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def test_rope_inv_freq_matches_transformers_llama3():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 64}  # all three bands at K=64
    hf_cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, rope_theta=500000.0,
                                      rope_scaling=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    got = rope_inv_freq(64, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64))
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    plain = rope_inv_freq(64, 500000.0)
    wavelen = 2 * torch.pi / plain
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long.any() and not (short | long).all()
    assert torch.equal(got[short], plain[short]) and torch.equal(got[long], plain[long] / 8)


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_llama3_rope_scaling_matches_logits(tie):
    hf = hf_model(tie, rope_scaling=dict(LLAMA3_ROPE))
    ours = from_hf(hf).eval()
    assert ours.cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    tokens = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
        unscaled = Llama(dataclasses.replace(ours.cfg, rope_scaling=None)).eval()
        unscaled.load_state_dict(ours.state_dict())
        assert (unscaled(tokens) - hf(tokens).logits).abs().max() > 1e-3  # the scaling matters
    back = to_hf(ours)  # round trip: the same config and logits again
    assert back.config.rope_parameters["rope_type"] == "llama3"
    assert from_hf(back).cfg == ours.cfg
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)


def test_rope_scaling_config_validation():
    assert LlamaConfig(rope_scaling={"factor": 32.0}).rope_scaling == RopeScaling(factor=32.0)
    with pytest.raises(ValueError, match="factor must be a positive number"):
        RopeScaling(factor=0.0)
    with pytest.raises(ValueError, match="must exceed low_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=4.0)
    with pytest.raises(TypeError, match="rope_scaling must be"):
        LlamaConfig(rope_scaling=8.0)


def test_from_hf_refuses_other_rope_types_and_architectures():
    pytest.importorskip("transformers")
    hf = hf_model()
    config = copy.deepcopy(hf.config)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        from_hf(hf.state_dict(), config)
    config = copy.deepcopy(hf.config)
    config.model_type = "gemma"
    with pytest.raises(ValueError, match="model_type 'gemma'"):
        from_hf(hf.state_dict(), config)

"""A Llama-style decoder in plain PyTorch: the unsharded reference that parallel plans transform.

Pre-norm blocks of RMSNorm -> attention (RoPE, causal, grouped-query) and RMSNorm -> SwiGLU MLP,
as in Llama 2/3. Submodule names are stable because plans address layers by them:
`tok_emb`, `layers.<i>.attn_norm`, `layers.<i>.attn.{wq,wk,wv,wo}`, `layers.<i>.mlp_norm`,
`layers.<i>.mlp.{w_gate,w_up,w_down}`, `norm`, `output`. Head counts are read from the weights
(`view(B, S, -1, head_dim)`), so a plan may shard heads across ranks without touching this code.

RoPE uses the rotate-half convention of Hugging Face's Llama, so `from_hf` / `to_hf` copy weights
unchanged (Meta's original checkpoints interleave pairs; HF permutes wq/wk when converting them).

Shape suffixes: B batch, S sequence, D model dim, H heads, G kv heads, K head dim, F ffn hidden,
V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.models.config import (PRESETS, LlamaConfig, RopeScaling,  # noqa: F401
                                    flops_per_token, matmul_params, num_params)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.float()  # normalise in float32 whatever the activation dtype, as HF does
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(x_BSD.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  device=None) -> torch.Tensor:
    """The K/2 rotary frequencies (float32), rescaled as Llama 3.1 does if ``scaling``: long
    wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    ctx, low, high = scaling.original_max_seq_len, scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (ctx / wavelen - low) / (high - low)  # 0 at ctx/low, 1 at ctx/high
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > ctx / low, inv_freq / scaling.factor, inv_freq)
    return torch.where((wavelen >= ctx / high) & (wavelen <= ctx / low), blended, scaled)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None,
                 scaling: RopeScaling | None = None):
    """cos_SK, sin_SK of rotary embeddings for positions 0..seq_len-1 (float32, rotate-half)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    angles_SK = torch.cat((angles, angles), dim=-1)
    return angles_SK.cos(), angles_SK.sin()


def apply_rope(x_BSHK: torch.Tensor, cos_SK: torch.Tensor, sin_SK: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + K/2]) pair by its position's angle (HF's rotate_half)."""
    x1, x2 = x_BSHK.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos_SK[:, None, :].to(x_BSHK.dtype), sin_SK[:, None, :].to(x_BSHK.dtype)
    return x_BSHK * cos + rotated * sin


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees [Sq, Sk] (True: attends): causal, and with a sliding
    ``window`` only the last ``window`` positions up to its own (transformers' rule,
    ``q - window < k <= q``)."""
    q, k = q_pos[:, None], k_pos[None, :]
    return (k <= q) if window is None else (k <= q) & (k > q - window)


class Attention(nn.Module):
    """Grouped-query attention; with ``cfg.qkv_bias`` biased q/k/v projections (Qwen2), with
    ``cfg.qk_norm`` an RMSNorm over each q and k head before RoPE (Qwen3), and with a
    ``window`` sliding-window attention (Mistral)."""

    def __init__(self, cfg: LlamaConfig, window: int | None = None):
        super().__init__()
        self.head_dim, self.window = cfg.head_dim, window
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x_BSD: torch.Tensor, cos_SK: torch.Tensor, sin_SK: torch.Tensor):
        B, S, _ = x_BSD.shape
        q_BSHK = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k_BSGK = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q_BSHK, k_BSGK = self.q_norm(q_BSHK), self.k_norm(k_BSGK)
        q_BSHK, k_BSGK = apply_rope(q_BSHK, cos_SK, sin_SK), apply_rope(k_BSGK, cos_SK, sin_SK)
        v_BSGK = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BSGK, v_BSGK))  # heads before sequence
        n_rep = q.size(1) // k.size(1)
        if n_rep > 1:  # GQA: query head h reads kv head h // n_rep
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        if self.window is None or self.window >= S:
            o_BHSK = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            pos = torch.arange(S, device=x_BSD.device)
            o_BHSK = F.scaled_dot_product_attention(q, k, v,
                                                    attn_mask=window_mask(pos, pos, self.window))
        return self.wo(o_BHSK.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate(x)) * w_up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_BSD)) * self.w_up(x_BSD))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, window: int | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, window)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x_BSD: torch.Tensor, cos_SK: torch.Tensor, sin_SK: torch.Tensor):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SK, sin_SK)
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, cfg.window(i))
                                    for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.init_weights()  # ties output to tok_emb if cfg.tie_embeddings

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) weights, the residual outputs (wo, w_down) scaled down by
        sqrt(2 * n_layers) as in GPT-2, norm gains 1. Also for a model built on the meta device
        and moved with to_empty() (which unties tied weights: they are tied again here)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_emb.weight
        residual_out = ("attn.wo.weight", "mlp.w_down.weight")
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                scale = math.sqrt(2 * self.cfg.n_layers) if name.endswith(residual_out) else 1.0
                p.normal_(0.0, self.cfg.init_std / scale, generator=generator)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Logits_BSV of the next token at every position."""
        S = tokens_BS.size(1)
        if S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos_SK, sin_SK = rope_cos_sin(S, self.cfg.head_dim, self.cfg.rope_theta, tokens_BS.device,
                                      self.cfg.rope_scaling)
        x_BSD = self.tok_emb(tokens_BS)
        for layer in self.layers:
            x_BSD = layer(x_BSD, cos_SK, sin_SK)
        return self.output(self.norm(x_BSD))

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (computed in float32); targets of -100 are ignored."""
        logits_BSV = self(tokens_BS)
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten(),
                               ignore_index=-100)


# --- Hugging Face interop (transformers is imported only here) --------------------------------

_HF_BLOCK = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             **{f"attn.w{c}": f"self_attn.{c}_proj" for c in "qkvo"},
             **{f"mlp.w_{c}": f"mlp.{c}_proj" for c in ("gate", "up", "down")}}


def _name_map(cfg: LlamaConfig) -> dict[str, str]:
    """Our parameter names -> LlamaForCausalLM's (Mistral's, Qwen2's and Qwen3's are the same,
    with Qwen2's q/k/v biases and Qwen3's q_norm / k_norm)."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    for i in range(cfg.n_layers):
        names.update({f"layers.{i}.{ours}.weight": f"model.layers.{i}.{hf}.weight"
                      for ours, hf in _HF_BLOCK.items()})
        if cfg.qkv_bias:
            names.update({f"layers.{i}.attn.w{c}.bias": f"model.layers.{i}.self_attn.{c}_proj.bias"
                          for c in "qkv"})
        if cfg.qk_norm:
            names.update({f"layers.{i}.attn.{c}_norm.weight":
                          f"model.layers.{i}.self_attn.{c}_norm.weight" for c in "qk"})
    return names


HF_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The transformers ``model_type`` values `config_from_hf` models."""


def _hf_window(hf_config, model_type: str) -> tuple[int | None, tuple[int, ...]]:
    """(sliding window, the layers that attend fully despite it) of a transformers config."""
    window = getattr(hf_config, "sliding_window", None)
    if model_type in ("qwen2", "qwen3") and not getattr(hf_config, "use_sliding_window", False):
        window = None
    if window is None:
        return None, ()
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * \
        hf_config.num_hidden_layers
    return int(window), tuple(i for i, t in enumerate(types) if t != "sliding_attention")


def config_from_hf(hf_config) -> LlamaConfig:
    """Our LlamaConfig from a transformers Llama, Mistral (its sliding window too), Qwen2 (q/k/v
    biases; a sliding window on the layers its ``layer_types`` say) or Qwen3 (q/k norms)
    config: the same architecture and weight names; ValueError naming what we do not model
    (other architectures, an out-projection or MLP bias, other RoPE)."""
    # transformers >= 5 keeps RoPE settings in rope_parameters, 4.x in rope_theta / rope_scaling
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope = dict(rope or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = rope.get("rope_theta") or getattr(hf_config, "rope_theta", 10000.0)
    model_type = getattr(hf_config, "model_type", "llama")
    if model_type not in HF_TYPES:
        raise ValueError(f"unsupported HF config: model_type {model_type!r} (only "
                         f"{', '.join(map(repr, HF_TYPES))})")
    window, full_layers = _hf_window(hf_config, model_type)
    hidden, head_dim = hf_config.hidden_size, getattr(hf_config, "head_dim", None)
    unsupported = {
        "hidden_act != 'silu'": hf_config.hidden_act != "silu",
        "attention_bias (a bias on o_proj is not modelled; Qwen2's q/k/v biases are)":
            getattr(hf_config, "attention_bias", False),
        "mlp_bias": getattr(hf_config, "mlp_bias", False),
        f"rope_type {rope_type!r} (only 'default', 'llama3')": rope_type not in ("default",
                                                                                 "llama3"),
        "partial_rotary_factor != 1": rope.get("partial_rotary_factor", 1.0) != 1.0,
    }
    if any(unsupported.values()):
        raise ValueError(f"unsupported HF {model_type} config: "
                         f"{[k for k, v in unsupported.items() if v]}")
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]),
                              int(rope["original_max_position_embeddings"]))
    return LlamaConfig(
        vocab_size=hf_config.vocab_size, dim=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers, n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        ffn_hidden=hf_config.intermediate_size, max_seq_len=hf_config.max_position_embeddings,
        norm_eps=hf_config.rms_norm_eps, rope_theta=float(theta), rope_scaling=scaling,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        init_std=getattr(hf_config, "initializer_range", 0.02) or 0.02,
        attn_head_dim=None if head_dim in (None, hidden // hf_config.num_attention_heads)
        else head_dim,
        qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3", sliding_window=window,
        full_attention_layers=full_layers)


def from_hf(hf_model_or_state_dict, hf_config=None) -> Llama:
    """Our Llama with the weights of a transformers LlamaForCausalLM, MistralForCausalLM,
    Qwen2ForCausalLM or Qwen3ForCausalLM (or its state dict + config; `config_from_hf`).

    Weights are copied unchanged (same rotate-half RoPE) and keep their dtype.
    """
    if isinstance(hf_model_or_state_dict, nn.Module):
        hf_config = hf_config or hf_model_or_state_dict.config
        state = hf_model_or_state_dict.state_dict()
    elif hf_config is None:
        raise ValueError("from_hf(state_dict) needs hf_config, the transformers LlamaConfig")
    else:
        state = hf_model_or_state_dict
    cfg = config_from_hf(hf_config)
    names = _name_map(cfg)
    if cfg.tie_embeddings:
        del names["output.weight"]  # the same tensor as tok_emb.weight; HF may omit lm_head
    missing = [hf for hf in names.values() if hf not in state]
    extra = {k for k in set(state) - set(names.values()) - {"lm_head.weight"}
             if not k.endswith("rotary_emb.inv_freq")}
    if missing or extra:
        raise ValueError(f"HF state dict does not match: missing {missing}, unexpected {extra}")
    with torch.device("meta"):
        model = Llama(cfg)
    weights = {ours: state[hf].detach().clone() for ours, hf in names.items()}
    model.load_state_dict(weights, strict=not cfg.tie_embeddings, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_emb.weight
    return model


def to_hf(model: Llama):
    """A transformers LlamaForCausalLM with the same config and (copied) weights as `model`."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    cfg = model.cfg
    if cfg.qkv_bias or cfg.qk_norm or cfg.sliding_window is not None:
        raise ValueError("to_hf writes a transformers Llama: q/k/v biases, q/k norms and "
                         "sliding windows have no place in it")
    hf_config = HFLlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        rope_scaling=None if cfg.rope_scaling is None else {
            "rope_type": "llama3", "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_seq_len},
        initializer_range=cfg.init_std, attention_bias=False, mlp_bias=False)
    hf_model = LlamaForCausalLM(hf_config).to(model.tok_emb.weight.dtype)
    ours = model.state_dict()
    names = _name_map(cfg)
    with torch.no_grad():
        hf_params = dict(hf_model.named_parameters(remove_duplicate=False))
        for our_name, hf_name in names.items():
            hf_params[hf_name].copy_(ours[our_name])
    return hf_model.eval()

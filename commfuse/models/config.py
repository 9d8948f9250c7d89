"""The model's configuration, as data: `LlamaConfig`, named presets, parameter and FLOP counts.

Pure (no torch): the planner (`commfuse.sim`) reads the same configs the model is built from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rescaling of the rotary frequencies (Hugging Face ``rope_type="llama3"``).

    Wavelengths shorter than ``original_max_seq_len / high_freq_factor`` are kept, those longer
    than ``original_max_seq_len / low_freq_factor`` are stretched by ``factor``, and the band
    between is interpolated smoothly (`commfuse.models.llama.rope_inv_freq`).
    """

    factor: float = 8.0
    """How much the low frequencies are slowed down (8 in Llama 3.1, 32 in Llama 3.2 1B/3B)."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_seq_len / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_seq_len / high_freq_factor are left unchanged."""
    original_max_seq_len: int = 8192
    """The context length of pre-training (HF ``original_max_position_embeddings``)."""

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"RopeScaling.{name} must be a positive number, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"low_freq_factor ({self.low_freq_factor})")


@dataclass
class LlamaConfig:
    vocab_size: int = 4096
    """Tokens in the vocabulary (rows of tok_emb, columns of output)."""
    dim: int = 128
    """Model (hidden) dimension D."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads H; the head dim is dim // n_heads unless ``attn_head_dim`` says."""
    n_kv_heads: int | None = None
    """Key/value heads G for grouped-query attention; must divide n_heads. None: n_heads (MHA)."""
    ffn_hidden: int | None = None
    """Hidden size F of the SwiGLU MLP. None: Llama's rule, 8/3 * dim rounded up to 256."""
    max_seq_len: int = 256
    """Longest sequence the model accepts."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (10000 in Llama 2, 500000 in Llama 3)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1+ frequency rescaling (a `RopeScaling`, or its fields as a dict); None: none."""
    tie_embeddings: bool = False
    """Share one weight between tok_emb and output (Llama 3.2 1B/3B do)."""
    init_std: float = 0.02
    """Std of the normal init of every weight matrix (residual outputs scaled by 1/sqrt(2L))."""
    qkv_bias: bool = False
    """Biases on wq, wk, wv (Qwen2's); the out-projection and the MLP have none."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3's q_norm / k_norm)."""
    sliding_window: int | None = None
    """Sliding-window attention (Mistral's): position i attends to positions i-W+1..i only.
    None: full causal attention."""
    attn_head_dim: int | None = None
    """Width K of each attention head when it is not dim // n_heads (Qwen3 0.6B: 1024 / 16
    heads, K = 128); None: dim // n_heads."""
    full_attention_layers: tuple[int, ...] = ()
    """Layers that attend fully although ``sliding_window`` is set (Qwen2/Qwen3 window only
    the layers from ``max_window_layers`` on)."""

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"LlamaConfig.rope_scaling must be a RopeScaling, a dict or None, "
                            f"got {type(self.rope_scaling).__name__}")
        if self.ffn_hidden is None:
            self.ffn_hidden = 256 * math.ceil(int(8 * self.dim / 3) / 256)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LlamaConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.attn_head_dim is not None and (isinstance(self.attn_head_dim, bool) or not
                                               isinstance(self.attn_head_dim, int)
                                               or self.attn_head_dim < 1):
            raise ValueError(f"LlamaConfig.attn_head_dim must be a positive int or None, got "
                             f"{self.attn_head_dim!r}")
        if self.attn_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or not
                                                isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"LlamaConfig.sliding_window must be a positive int or None, got "
                             f"{self.sliding_window!r}")
        self.full_attention_layers = tuple(self.full_attention_layers)

    def window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (None: full causal attention)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """A named configuration from PRESETS, with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # Trains on a 2-core CPU in minutes; the vocabulary is commfuse.data's tokenizer.
    "tiny": dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4, ffn_hidden=384, max_seq_len=256),
    # About 31M parameters: a real (if short) run on a few CPUs or one GPU.
    "small": dict(vocab_size=4096, dim=512, n_layers=8, n_heads=8, ffn_hidden=1536,
                  max_seq_len=1024),
    # Real shapes, for planning (FLOPs, memory, shard sizes); build them on the meta device.
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,  # Llama 3.2 1B
               ffn_hidden=8192, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True,
               rope_scaling=RopeScaling(factor=32.0)),
    "7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008,  # Llama 2 7B
               max_seq_len=4096),
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,  # Llama 3 8B
               ffn_hidden=14336, max_seq_len=8192, rope_theta=500000.0),
    "70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,  # Llama 3 70B
                ffn_hidden=28672, max_seq_len=8192, rope_theta=500000.0),
}


def matmul_params(cfg: LlamaConfig) -> int:
    """Weights that take part in a GEMM: every Linear of every block, plus the output head."""
    attn = cfg.dim * cfg.head_dim * 2 * (cfg.n_heads + cfg.n_kv_heads)
    mlp = 3 * cfg.dim * cfg.ffn_hidden
    return cfg.n_layers * (attn + mlp) + cfg.dim * cfg.vocab_size


def num_params(cfg: LlamaConfig) -> int:
    """All parameters of Llama(cfg), a tied embedding counted once; no model is built."""
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    return matmul_params(cfg) + norms + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6*N + 12*L*H*Q*T.

    From PaLM (Chowdhery et al. 2022, appendix B), as in nanoGPT's `estimate_mfu`: N parameters
    in matmuls (here `matmul_params`; the embedding lookup does no matmul), L layers, H heads,
    Q head dim, T sequence length. The attention term counts the full T x T score matrix.
    """
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len

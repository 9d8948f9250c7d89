"""Model configs beyond the Llama block, for planning: mixture-of-experts layers and hybrid
Mamba-2 / attention stacks, as typed data (`HybridConfig`, `MoESpec`, `MambaSpec`) and presets.

    from commfuse.sim.step.arch import PRESETS, sublayers
    cfg = PRESETS["nemotron-h-8b"]
    sublayers(cfg)  # "M-M-M-M*-M-...": one character per layer

A `HybridConfig` is a `LlamaConfig` (its attention and dense-MLP fields keep their meaning, so
`commfuse.parallel.config.ParallelDims.check_model` and the Llama ops apply to those layers)
plus a layer pattern. Each character of the pattern is one residual sub-layer with its own
pre-norm: ``*`` attention, ``-`` dense SwiGLU MLP (``ffn_hidden``), ``E`` mixture-of-experts
(`MoESpec`), ``M`` Mamba-2 mixer (`MambaSpec`). Without a pattern the model is ``n_layers``
Llama blocks, ``*-`` each, or ``*E`` each when ``moe`` is set, the first
``moe.dense_layers`` of them ``*-`` (DeepSeek's dense-first layers).

Pure (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.models.config import LlamaConfig

KINDS = {"*": "attention", "-": "mlp", "E": "moe", "M": "mamba"}


@dataclass(frozen=True)
class MoESpec:
    """The routed layer of an MoE model: ``experts`` SwiGLU experts of width ``expert_ffn``,
    ``top_k`` per token, plus ``shared_ffn`` of always-active (shared) experts."""

    experts: int
    """Routed experts E; expert parallelism over ep ranks needs E divisible by ep."""
    top_k: int
    """Experts each token is routed to (k)."""
    expert_ffn: int
    """Hidden width of one routed expert's SwiGLU."""
    shared_ffn: int = 0
    """Total hidden width of the shared experts (DeepSeek: their count x their width; 0: none).
    They run as a dense SwiGLU MLP on every token, TP-sharded like one."""
    dense_layers: int = 0
    """Leading blocks whose MLP is dense (``ffn_hidden``), not MoE (DeepSeek's
    ``first_k_dense_replace``); used only without an explicit pattern."""

    def __post_init__(self):
        for name in ("experts", "top_k", "expert_ffn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoESpec.{name} must be a positive int, got {v!r}")
        for name in ("shared_ffn", "dense_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"MoESpec.{name} must be an int >= 0, got {v!r}")
        if self.top_k > self.experts:
            raise ValueError(f"MoESpec.top_k ({self.top_k}) exceeds the experts "
                             f"({self.experts})")


@dataclass(frozen=True)
class MambaSpec:
    """A Mamba-2 mixer (`commfuse.tp.mixers.mamba`): in_proj [z | x | B | C | dt], a causal depthwise
    conv1d over x | B | C, the SSD scan per head, a gated group RMSNorm, out_proj."""

    heads: int
    """SSM heads H; d_inner = H * head_dim (expand x the model width)."""
    head_dim: int
    """Channels P per head."""
    d_state: int
    """State size N per head."""
    n_groups: int
    """B/C groups G (H divisible by G)."""
    conv_kernel: int = 4
    """Width of the causal conv1d."""
    chunk: int = 128
    """SSD chunk length Q."""

    def __post_init__(self):
        for name in ("heads", "head_dim", "d_state", "n_groups", "conv_kernel", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MambaSpec.{name} must be a positive int, got {v!r}")
        if self.heads % self.n_groups:
            raise ValueError(f"MambaSpec.heads ({self.heads}) must be divisible by n_groups "
                             f"({self.n_groups})")

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d: x | B | C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj_out(self) -> int:
        """Rows of in_proj: z | x | B | C | dt."""
        return self.d_inner + self.conv_dim + self.heads

    def local(self, tp: int) -> tuple[int, int, int]:
        """(heads, B/C groups, in_proj rows) one of ``tp`` ranks owns: H/tp heads and their
        groups, G/tp of them or, when G < tp, the one group its heads read, replicated."""
        h, g = self.heads // tp, max(self.n_groups // tp, 1)
        return h, g, 2 * h * self.head_dim + 2 * g * self.d_state + h

    def check(self, tp: int) -> None:
        """ValueError when the mixer cannot be split over ``tp`` ranks (as `commfuse.tp.mixers.mamba`
        refuses it)."""
        if self.heads % tp:
            raise ValueError(f"Mamba heads ({self.heads}) must be divisible by tp={tp} "
                             f"(each rank owns whole SSM heads)")
        if self.n_groups % tp and tp % self.n_groups:
            raise ValueError(f"Mamba n_groups ({self.n_groups}) and tp={tp} must divide one "
                             f"another (B/C groups are split, or replicated when fewer)")


@dataclass
class HybridConfig(LlamaConfig):
    """A `LlamaConfig` with MoE and/or Mamba-2 layers (module doc)."""

    pattern: str = ""
    """One character per layer: ``*`` attention, ``-`` MLP, ``E`` MoE, ``M`` Mamba-2 (module
    doc); "" for ``n_layers`` Llama blocks (``*E`` with ``moe``). With a pattern,
    ``n_layers`` is its length."""
    moe: MoESpec | None = None
    """The routed experts of ``E`` layers."""
    mamba: MambaSpec | None = None
    """The mixer of ``M`` layers."""

    def __post_init__(self):
        super().__post_init__()
        if self.pattern:
            bad = sorted(set(self.pattern) - set(KINDS))
            if bad:
                raise ValueError(f"HybridConfig.pattern has unknown layer kinds {bad}; "
                                 f"use {', '.join(f'{k!r} {v}' for k, v in KINDS.items())}")
            self.n_layers = len(self.pattern)
        s = sublayers(self)
        if "E" in s and self.moe is None:
            raise ValueError("HybridConfig: the pattern has MoE layers (E) but moe is None")
        if "M" in s and self.mamba is None:
            raise ValueError("HybridConfig: the pattern has Mamba layers (M) but mamba is None")
        if self.moe is not None and self.moe.dense_layers > self.n_layers:
            raise ValueError(f"MoESpec.dense_layers ({self.moe.dense_layers}) exceeds the "
                             f"{self.n_layers} blocks")


def sublayers(cfg) -> str:
    """The model's layers as pattern characters (module doc); a plain `LlamaConfig`: "*-"
    per block."""
    pattern = getattr(cfg, "pattern", "")
    if pattern:
        return pattern
    moe = getattr(cfg, "moe", None)
    dense = moe.dense_layers if moe else cfg.n_layers
    return "".join("*-" if i < dense else "*E" for i in range(cfg.n_layers))


def is_hybrid(cfg) -> bool:
    """Whether ``cfg`` has layers other than Llama blocks (MoE or Mamba)."""
    return isinstance(cfg, HybridConfig) and (cfg.moe is not None or bool(cfg.pattern))


EP_AXES = ("dp", "tp")


def expert_groups(tp: int, dp: int, ep: int, ep_axis: str = "dp") -> tuple[str, int, str, int]:
    """(axis, size) of the MoE layers' all-to-all group and (axis, size) of the ZeRO shards of
    each rank's experts: ep of the DP ranks and the other dp/ep ("ep", "edp"), or, with
    ``ep_axis="tp"`` (what ``commfuse train --ep`` runs), the TP group and all dp ranks."""
    if ep_axis == "tp":
        return "tp", tp, "dp", dp
    return "ep", ep, "edp", dp // ep


def check_layout(cfg, tp: int, up: int, dp: int, ep: int, ep_axis: str = "dp") -> None:
    """ValueError when ``cfg``'s MoE or Mamba layers cannot run on (tp, up, dp, ep): ep
    divides the experts and dp (the expert-parallel group is taken from the DP ranks; with
    ``ep_axis="tp"`` it is the TP group, ep = tp), the shared experts' width divides tp,
    Mamba's heads and groups split over tp, no Ulysses (up) for Mamba (its scan runs over
    the whole sequence of a rank's heads)."""
    s = sublayers(cfg)
    moe = getattr(cfg, "moe", None)
    if ep_axis not in EP_AXES:
        raise ValueError(f"ep_axis must be one of {EP_AXES}, got {ep_axis!r}")
    if ep_axis == "tp" and (ep != tp or up > 1):
        raise ValueError(f"ep={ep} over the TP group needs ep = tp ({tp}) and no up")
    if ep < 1 or (ep_axis == "dp" and dp % ep):
        raise ValueError(f"ep={ep} must divide dp={dp} (experts are split over DP ranks)")
    if ep > 1 and "E" not in s:
        raise ValueError(f"ep={ep}: the model has no MoE layers")
    if moe is not None and "E" in s:
        if moe.experts % ep:
            raise ValueError(f"experts ({moe.experts}) must be divisible by ep={ep}")
        if moe.shared_ffn % tp:
            raise ValueError(f"shared experts' width ({moe.shared_ffn}) must be divisible by "
                             f"tp={tp}")
    if "M" in s:
        if up > 1:
            raise ValueError(f"up={up}: Ulysses is not modelled for Mamba layers (the scan "
                             f"runs over a rank's whole sequence)")
        cfg.mamba.check(tp)


def matmul_weights(cfg, kind: str) -> tuple[float, float]:
    """(dense, expert) matmul weights of one layer of ``kind`` (a pattern character), whole
    (not sharded): dense = attention, MLP, Mamba projections and conv1d, the router and the
    shared experts; expert = all routed experts."""
    D, hd = cfg.dim, cfg.head_dim
    if kind == "*":
        return D * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads), 0.0
    if kind == "-":
        return 3 * D * cfg.ffn_hidden, 0.0
    if kind == "E":
        m = cfg.moe
        return D * m.experts + 3 * D * m.shared_ffn, 3 * D * m.expert_ffn * m.experts
    m = cfg.mamba  # "M"
    return D * m.in_proj_out + m.conv_dim * m.conv_kernel + m.d_inner * D, 0.0


def scan_flops(mamba: MambaSpec, seq: int) -> float:
    """Forward FLOPs per token of one mixer's SSD scan (`commfuse.train.hf_flops`'s count:
    C B^T and its product with x over a chunk, the chunk state and its read-out)."""
    Q = min(mamba.chunk, seq)
    return 2 * mamba.heads * (Q * (mamba.d_state + mamba.head_dim)
                              + 2 * mamba.d_state * mamba.head_dim)


def active_params(cfg) -> float:
    """Weights a token meets once: every layer's matmuls with top_k of the routed experts,
    and the output head (not the embedding)."""
    n = cfg.dim * cfg.vocab_size
    for kind in sublayers(cfg):
        dense, expert = matmul_weights(cfg, kind)
        n += dense + (expert * cfg.moe.top_k / cfg.moe.experts if expert else 0.0)
    return n


def flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token: 6 N_active + 12 L_attn H Q T (PaLM appendix B, as
    `commfuse.models.config.flops_per_token`) + 3 x the Mamba layers' scan (as
    `commfuse.train.hf_flops`, the numerator of ``commfuse train --hf-config``'s MFU)."""
    s = sublayers(cfg)
    attn = 12 * s.count("*") * cfg.n_heads * cfg.head_dim * seq
    scan = 3 * s.count("M") * scan_flops(cfg.mamba, seq) if "M" in s else 0.0
    return 6 * active_params(cfg) + attn + scan


def model_flops_per_token(cfg, seq: int) -> float:
    """The MFU numerator of any config: `commfuse.models.config.flops_per_token` for Llama
    blocks, `flops_per_token` for MoE and Mamba layers."""
    from commfuse.models.config import flops_per_token as llama_flops

    return flops_per_token(cfg, seq) if is_hybrid(cfg) else llama_flops(cfg, seq)


# Presets. Sources (Hugging Face config.json of each model):
# mistralai/Mixtral-8x7B-v0.1: hidden 4096, 32 layers, 32 heads, 8 kv heads, 8 experts,
#   top-2, intermediate 14336, vocab 32000.
# Qwen/Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads, 4 kv heads, head_dim 128, 128
#   experts, top-8, moe_intermediate 768, vocab 151936.
# deepseek-ai/DeepSeek-V2-Lite: hidden 2048, 27 layers, 16 heads, 64 routed experts, top-6,
#   moe_intermediate 1408, 2 shared experts, first_k_dense_replace 1, dense intermediate
#   10944, vocab 102400. Its multi-head latent attention is planned as 16-head MHA of head
#   dim 128 (v_head_dim; the compressed kv projections are not modelled).
# nvidia/Nemotron-H-8B-Base-8K (the defaults of NemotronHConfig in vLLM's
#   transformers_utils/configs/nemotron_h.py, docs.vllm.ai v0.10.2): hidden 4096, 52 layers
#   "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" (24 Mamba-2, 4 attention, 24
#   MLP), 32 heads, 8 kv heads, head_dim 128, Mamba 128 heads of 64, state 128, 8 groups,
#   conv 4, chunk 128, squared-ReLU MLP of 21504, vocab 131072. The squared-ReLU MLP (up and
#   down, D x 21504 each) is planned as a SwiGLU of width 14336 = 2/3 x 21504: the same
#   weights, FLOPs and collective bytes.
PRESET_FIELDS: dict[str, dict] = {
    "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_hidden=14336, max_seq_len=32768, rope_theta=1e6,
                         moe=MoESpec(experts=8, top_k=2, expert_ffn=14336)),
    "qwen3-30b-a3b": dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          attn_head_dim=128, ffn_hidden=6144, max_seq_len=40960,
                          rope_theta=1e6, qk_norm=True,
                          moe=MoESpec(experts=128, top_k=8, expert_ffn=768)),
    "deepseek-v2-lite": dict(vocab_size=102400, dim=2048, n_layers=27, n_heads=16,
                             attn_head_dim=128, ffn_hidden=10944, max_seq_len=32768,
                             moe=MoESpec(experts=64, top_k=6, expert_ffn=1408,
                                         shared_ffn=2 * 1408, dense_layers=1)),
    "nemotron-h-8b": dict(vocab_size=131072, dim=4096, n_heads=32, n_kv_heads=8,
                          ffn_hidden=14336, max_seq_len=8192,
                          pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                          mamba=MambaSpec(heads=128, head_dim=64, d_state=128, n_groups=8,
                                          conv_kernel=4, chunk=128)),
}


def preset(name: str) -> HybridConfig:
    """A `HybridConfig` preset by name (``PRESET_FIELDS``)."""
    if name not in PRESET_FIELDS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESET_FIELDS)}")
    return HybridConfig(**PRESET_FIELDS[name])

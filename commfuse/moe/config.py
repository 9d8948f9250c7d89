"""An MoE layer's configuration, as data: `MoEConfig` and named presets.

Pure (no torch), like `commfuse.models.config`, so a planner can read the same configs the
layers are built from.
"""

from __future__ import annotations

from dataclasses import dataclass

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """A top-k routed layer of SwiGLU experts (`commfuse.moe.layer.MoELayer`)."""

    dim: int = 32
    """Model (hidden) dimension D: the layer's input and output width."""
    ffn: int = 64
    """Hidden size F of each expert's SwiGLU MLP."""
    experts: int = 8
    """Experts E; expert parallelism over W ranks needs E divisible by W."""
    top_k: int = 2
    """Experts each token is sent to (k)."""
    score: str = "softmax"
    """How router logits become scores: "softmax" over the experts (Mixtral, Qwen3-MoE) or an
    independent "sigmoid" per expert (DeepSeek-V3's scoring, without its bias terms)."""
    normalize: bool = True
    """Renormalise the k chosen scores to sum to 1 (Mixtral always; Qwen3-MoE's
    ``norm_topk_prob``); False keeps them as scored."""

    def __post_init__(self):
        for name in ("dim", "ffn", "experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds the experts "
                             f"({self.experts})")
        if self.score not in SCORES:
            raise ValueError(f"MoEConfig.score must be one of {SCORES}, got {self.score!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"MoEConfig.normalize must be a bool, got {self.normalize!r}")


PRESETS = {
    "tiny": MoEConfig(),  # a laptop CPU's: 8 experts, top-2, D=32
    "mixtral-8x7b": MoEConfig(dim=4096, ffn=14336, experts=8, top_k=2),
    "qwen3-30b-a3b": MoEConfig(dim=2048, ffn=768, experts=128, top_k=8),
}

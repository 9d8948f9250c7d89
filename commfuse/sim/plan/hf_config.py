"""A transformers ``config.json`` as a planner config: ``commfuse plan --hf-config``.

    from commfuse.sim.plan.hf_config import from_hf
    cfg = from_hf("mixtral-tiny")     # commfuse/data/hf/mixtral-tiny.json, as `commfuse train`
    cfg = from_hf("path/to/config.json")   # or a model directory holding one

Read as JSON (no transformers, no torch). Model types: llama, mistral, qwen2, qwen3 (a
`LlamaConfig`); mixtral, qwen3_moe (its ``mlp_only_layers`` and ``decoder_sparse_step``
give dense layers), bamba, mamba2 and nemotron_h (a `commfuse.sim.step.arch.HybridConfig`).
Nemotron-H's squared-ReLU MLP of width F is planned as a SwiGLU of 2F/3 (the same weights
and FLOPs, `commfuse.sim.step.arch`), rounded up to a multiple of 8 so that TP splits it (for
F = 344, 232 in place of 229.3: 1.2 % more MLP weights); its MoE layers are not planned. A pure Mamba-2 model has no attention or MLP: its unused attention fields are its
SSM heads and its MLP width d_inner, so that the layout checks divide as its heads do.
"""

from __future__ import annotations

import json
from pathlib import Path

from commfuse.models.config import LlamaConfig
from commfuse.sim.step.arch import HybridConfig, MambaSpec, MoESpec

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "hf"
LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PLANNED_TYPES = LLAMA_TYPES + ("mixtral", "qwen3_moe", "bamba", "mamba2", "nemotron_h")
NEMOTRON_KINDS = {"linear_attention": "M", "mamba": "M", "full_attention": "*",
                  "attention": "*", "mlp": "-", "moe": "E"}


def load(name_or_path: str) -> dict:
    """The JSON of a shipped name (commfuse/data/hf/NAME.json), a file or a directory."""
    shipped = SHIPPED / f"{name_or_path}.json"
    path = Path(name_or_path)
    path = shipped if shipped.is_file() else path / "config.json" if path.is_dir() else path
    if not path.is_file():
        known = sorted(p.stem for p in SHIPPED.glob("*.json"))
        raise ValueError(f"no config {name_or_path!r}: a shipped name ({', '.join(known)}), a "
                         f"config.json or a directory holding one")
    return json.loads(path.read_text())


def from_hf(name_or_path) -> LlamaConfig:
    """The planner's config of a transformers config (module doc): a name, a path or the
    loaded dict."""
    hf = name_or_path if isinstance(name_or_path, dict) else load(name_or_path)
    kind = hf.get("model_type")
    D = hf["hidden_size"]
    common = dict(vocab_size=hf["vocab_size"], dim=D,
                  max_seq_len=hf.get("max_position_embeddings", 4096),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    if kind != "mamba2":
        H = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or D // H
        common.update(n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                      attn_head_dim=None if head_dim * H == D else head_dim,
                      ffn_hidden=hf.get("intermediate_size"))
    L = hf.get("num_hidden_layers")
    if kind in LLAMA_TYPES:
        return LlamaConfig(n_layers=L, **common)
    if kind == "mixtral":
        return HybridConfig(n_layers=L, moe=MoESpec(hf["num_local_experts"],
                                                    hf["num_experts_per_tok"],
                                                    hf["intermediate_size"]), **common)
    if kind == "qwen3_moe":
        dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
        pattern = "".join("*" + ("E" if i not in dense and (i + 1) % step == 0 else "-")
                          for i in range(L))
        return HybridConfig(pattern=pattern, moe=MoESpec(hf["num_experts"],
                                                         hf["num_experts_per_tok"],
                                                         hf["moe_intermediate_size"]),
                            **common)
    if kind == "bamba":
        attn = set(hf.get("attn_layer_indices") or ())
        pattern = "".join(("*" if i in attn else "M") + "-" for i in range(L))
        mamba = MambaSpec(hf["mamba_n_heads"], hf["mamba_d_head"], hf["mamba_d_state"],
                          hf["mamba_n_groups"], hf.get("mamba_d_conv", 4),
                          hf.get("mamba_chunk_size", 256))
        return HybridConfig(pattern=pattern, mamba=mamba, **common)
    if kind == "mamba2":
        mamba = MambaSpec(hf["num_heads"], hf["head_dim"], hf["state_size"], hf["n_groups"],
                          hf.get("conv_kernel", 4), hf.get("chunk_size", 256))
        return HybridConfig(pattern="M" * L, mamba=mamba, n_heads=mamba.heads,
                            attn_head_dim=mamba.head_dim, ffn_hidden=mamba.d_inner, **common)
    if kind == "nemotron_h":
        types = hf.get("layers_block_type")
        pattern = "".join(NEMOTRON_KINDS[t] for t in types) if types \
            else hf["hybrid_override_pattern"]
        if "E" in pattern:
            raise ValueError("nemotron_h: its MoE layers (squared-ReLU experts) are not planned")
        F = -(-2 * hf["intermediate_size"] // 24) * 8  # 2/3 of it, up to a multiple of 8
        mamba = MambaSpec(hf["mamba_num_heads"], hf["mamba_head_dim"], hf["ssm_state_size"],
                          hf["n_groups"], hf.get("conv_kernel", 4), hf.get("chunk_size", 256))
        return HybridConfig(pattern=pattern, mamba=mamba, **{**common, "ffn_hidden": F})
    raise ValueError(f"model_type {kind!r} is not planned; use one of "
                     f"{', '.join(PLANNED_TYPES)}")

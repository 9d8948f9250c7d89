"""The transformers families `commfuse.tp.parallelize` is tested on, their tiny models, and
docs/support.md's sections generated from this registry, the others the code keeps and the
sweep's results.

``FAMILIES``: name -> `Family` (its config and model classes, a tiny config that the tests
build on 2 and 4 ranks, or on 2 only for ``TWO_RANKS``, the plan mechanisms it exercises).
``COMPILED``, ``FSDP2`` and ``GENERATE``: the families the torch.compile, FSDP2 and
``model.generate`` tests run. docs/support.md's generated sections: `support_matrix`, each
family against what takes it (read from where the code decides it: the shipped
``--hf-config`` files, the model types `commfuse generate` loads, the model types `commfuse
plan` prices), and `sweep_section`, scripts/family_sweep.py's docs/support-sweep.csv.
``python -m commfuse.tp.families`` prints the matrix; ``--write`` puts both in docs/support.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# a tiny decoder: vocab 63 and 2 layers, 4 heads of 8 over 2 kv heads (uneven vocab shards)
TINY = dict(vocab_size=63, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=0)
# DeepSeek-V3's multi-head latent attention, every layer dense (first_k_dense_replace)
MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
           qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=2)
WINDOWS = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)  # top-2 of 4 experts
# Qwen3.5: 3 Gated DeltaNet layers to 1 gated attention; 2 key heads over 4 value heads (on
# 4 ranks the key heads are replicated)
QWEN3_5 = dict(num_hidden_layers=4, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
# the decay rates A = exp(A_log) drawn from [0.01, 1] instead of the model's [0.01, 16]: with
# A up to 16 the chunked rule subtracts cumulative decays of about -200 in float32, so the
# unsharded model's own gradients are 2e-5 off their float64 values (above the tests' 1e-5)
# and any other summation order lands as far off
SMALL_DECAY = {"A_log": (-4.6, 0.0)}
# Mamba-2 mixers of 8 SSM heads of 4 over 2 B/C groups of state 8 (the groups split on 2
# ranks, replicated on 4), 3 scan chunks of 4 over 11 tokens
MAMBA2 = dict(vocab_size=63, hidden_size=16, expand=2, num_heads=8, head_dim=4, state_size=8,
              n_groups=2, chunk_size=4, num_hidden_layers=2, conv_kernel=4,
              tie_word_embeddings=False)
# Bamba: layer 0 Mamba-2, layer 1 attention (4 heads, 2 kv heads), SwiGLU MLPs
BAMBA = dict(vocab_size=63, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
             attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
             mamba_n_heads=8, mamba_d_head=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
             mamba_expand=2, mamba_chunk_size=4, max_position_embeddings=64,
             tie_word_embeddings=False)
# Nemotron-H's pattern "M-*-": Mamba-2 (conv bias), squared-ReLU MLP, attention without RoPE
NEMOTRON_H = dict(vocab_size=63, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                  layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=4, mamba_num_heads=8,
                  mamba_head_dim=4, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
# the hybrids of hidden size 32: Mamba-2 mixers of 8 heads over 2 groups, as above
HYBRID = dict(mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
              mamba_chunk_size=4)
# Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, its gated norm
# normalising before the gate, and every muP multiplier away from 1 (ssm_multipliers: the
# in_proj rows z | x | B | C | dt, split with the rows)
FALCON_H1 = dict(HYBRID, mamba_d_head=4, mamba_d_ssm=32, mamba_rms_norm=True,
                 mamba_conv_bias=True, mamba_proj_bias=True, projectors_bias=True,
                 mlp_multipliers=[0.7, 1.3], ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0],
                 key_multiplier=0.9, attention_in_multiplier=1.1, attention_out_multiplier=0.8,
                 ssm_in_multiplier=1.25, ssm_out_multiplier=0.75, embedding_multiplier=2.0,
                 lm_head_multiplier=0.5)
# Granite 4.0-H: a Mamba-2 layer and an attention layer (no RoPE, as shipped), each with a
# sparse MoE block (4 experts, top 2) and a shared SwiGLU MLP (input_linear: gate | up)
GRANITE_4 = dict(HYBRID, layer_types=["linear_attention", "full_attention"],
                 num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                 shared_intermediate_size=24, embedding_multiplier=2.0, logits_scaling=2.0,
                 residual_multiplier=0.5, attention_multiplier=0.2)


@dataclass(frozen=True)
class Family:
    """A transformers causal-LM family: ``config`` / ``model`` class names, its
    ``model_type``, the ``tiny`` config (over `TINY`) the tests build, and the plan
    mechanisms it exercises; ``test``: the test file that checks it against one process;
    ``redraw``: parameters (by name) drawn again, uniform in (low, high), after the model's
    own initialisation."""

    config: str
    model: str
    model_type: str
    tiny: dict = field(default_factory=dict)
    mechanisms: tuple[str, ...] = ()
    test: str = "tests/test_tp_families.py"
    redraw: dict = field(default_factory=dict)


FAMILIES = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "llama", test="tests/test_tp.py"),
    "mistral": Family("MistralConfig", "MistralForCausalLM", "mistral",
                      {"sliding_window": 4}, ("sliding window",)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", "qwen2", mechanisms=("q/k/v biases",),
                    test="tests/test_tp.py"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {"head_dim": 8},
                    ("per-head norms",), test="tests/test_tp.py"),
    "llama-tied": Family("LlamaConfig", "LlamaForCausalLM", "llama",
                         {"tie_word_embeddings": True}, ("tied embeddings",)),
    "qwen3-tied": Family("Qwen3Config", "Qwen3ForCausalLM", "qwen3",
                         {"head_dim": 8, "tie_word_embeddings": True},
                         ("tied embeddings", "per-head norms")),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", "gemma2",
                     {"head_dim": 8, "sliding_window": 4, "query_pre_attn_scalar": 16,
                      "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
                     ("tied embeddings", "soft-capping", "sandwich norms", "scaled embedding")),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3_text",
                     {"head_dim": 8, "final_logit_softcapping": 30.0, **WINDOWS},
                     ("tied embeddings", "soft-capping", "sandwich norms", "per-head norms",
                      "sliding window")),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", "phi3", {"num_key_value_heads": 4},
                   ("packed q|k|v", "packed gate|up")),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", "olmo2", {},
                    ("split-dim norms", "post norms")),
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", "olmo3", {"sliding_window": 4},
                    ("split-dim norms", "post norms", "sliding window")),
    "glm4": Family("Glm4Config", "Glm4ForCausalLM", "glm4", {"head_dim": 8},
                   ("packed gate|up", "sandwich norms", "partial rotary")),
    "cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", "cohere2", WINDOWS,
                      ("tied embeddings", "parallel attention + MLP", "logit scale")),
    "exaone4": Family("Exaone4Config", "Exaone4ForCausalLM", "exaone4", WINDOWS,
                      ("per-head norms", "post norms")),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", "granite", {},
                      ("multipliers",)),
    "qwen3.5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "qwen3_5_text", QWEN3_5,
                      ("gated DeltaNet", "gated attention", "per-head norms"),
                      redraw=SMALL_DECAY),
    "qwen3-next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", "qwen3_next",
                         {**QWEN3_5, **MOE, "num_experts": 4,
                          "shared_expert_intermediate_size": 16},
                         ("gated DeltaNet (packed qkvz/ba)", "gated attention", "sparse MoE",
                          "shared experts", "shared-expert gate"), redraw=SMALL_DECAY),
    "apertus": Family("ApertusConfig", "ApertusForCausalLM", "apertus", {"head_dim": 8},
                      ("activation parameters", "per-head norms")),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", "mixtral",
                      {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
                      ("sparse MoE",), test="tests/test_moe_hf.py"),
    "qwen3-moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe",
                        {**MOE, "num_experts": 4, "head_dim": 8, "mlp_only_layers": [0]},
                        ("sparse MoE", "dense layers"), test="tests/test_moe_hf.py"),
    "qwen2-moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe",
                        {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 24},
                        ("sparse MoE", "shared experts", "shared-expert gate", "q/k/v biases")),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", "olmoe",
                    {"num_experts": 4, "eos_token_id": 1, **MOE},
                    ("sparse MoE", "split-dim norms")),
    "glm4-moe": Family("Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4_moe",
                       {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "head_dim": 8,
                        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                        "routed_scaling_factor": 2.5},
                       ("sparse MoE", "shared experts", "group-limited routing",
                        "score-correction bias", "routed scaling", "dense first layers")),
    "gpt-oss": Family("GptOssConfig", "GptOssForCausalLM", "gpt_oss",
                      {**MOE, **WINDOWS, "num_local_experts": 4, "intermediate_size": 16,
                       "head_dim": 8, "rope_parameters": {"rope_type": "default",
                                                          "rope_theta": 10000.0}},
                      ("sparse MoE", "attention sinks", "expert and router biases",
                       "interleaved gate|up", "clamped SwiGLU", "sliding window")),
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM", "llama4_text",
                     {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16,
                      "intermediate_size_mlp": 40, "head_dim": 8, "no_rope_layer_interval": 2,
                      "attention_chunk_size": 4, "interleave_moe_layer_step": 1},
                     ("sparse MoE", "shared experts", "experts on scaled tokens",
                      "chunked attention", "no-rope layers", "q/k L2 norm")),
    "deepseek-v3-dense": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek_v3",
                                MLA, ("multi-head latent attention",)),
    "deepseek-v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek_v3",
                          {**MLA, **MOE, "n_routed_experts": 4, "n_shared_experts": 1,
                           "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                           "routed_scaling_factor": 2.5},
                          ("multi-head latent attention", "sparse MoE", "shared experts",
                           "group-limited routing", "score-correction bias", "routed scaling",
                           "dense first layers")),
    "deepseek-v2-lite": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", "deepseek_v2",
                               {**MLA, **MOE, "q_lora_rank": None, "n_routed_experts": 4,
                                "n_shared_experts": 1, "first_k_dense_replace": 1},
                               ("multi-head latent attention", "no q latent", "sparse MoE",
                                "shared experts", "dense first layers")),
    "mamba2": Family("Mamba2Config", "Mamba2ForCausalLM", "mamba2", MAMBA2, ("Mamba-2",),
                     test="tests/test_tp_mamba.py"),
    "bamba": Family("BambaConfig", "BambaForCausalLM", "bamba", BAMBA,
                    ("Mamba-2", "hybrid layers"), test="tests/test_tp_mamba.py"),
    "nemotron-h": Family("NemotronHConfig", "NemotronHForCausalLM", "nemotron_h", NEMOTRON_H,
                         ("Mamba-2", "hybrid layers", "one mixer per layer", "no-rope layers",
                          "squared-ReLU MLP"), test="tests/test_tp_mamba.py"),
    "falcon-h1": Family("FalconH1Config", "FalconH1ForCausalLM", "falcon_h1", FALCON_H1,
                        ("Mamba-2", "parallel attention + Mamba-2", "muP multipliers",
                         "norm before gate")),
    "granite-4-h": Family("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                          "granitemoehybrid", GRANITE_4,
                          ("Mamba-2", "hybrid layers", "sparse MoE", "shared experts",
                           "packed gate|up", "no-rope layers", "multipliers")),
    "beam": Family("BeamConfig", "BeamForCausalLM", "beam",
                   {**MOE, **WINDOWS, "num_experts": 4, "head_dim": 8, "n_group": 2,
                    "topk_group": 1, "mlp_layer_types": ["dense", "sparse"]},
                   ("sparse MoE", "depth-scaled residuals", "gated attention")),
    "mimo-v2-flash": Family("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", "mimo_v2_flash",
                            {**MOE, "n_routed_experts": 4, "n_group": 2, "head_dim": 8,
                             "v_head_dim": 8, "sliding_window": 4,
                             "layer_types": ["full_attention", "sliding_attention"],
                             "mlp_layer_types": ["dense", "sparse"]},
                            ("kv heads per layer", "attention sinks", "sparse MoE")),
}
# families checked on 2 ranks only (what scripts/family_sweep.py found wrong; the mechanisms
# beside it are the other families')
TWO_RANKS = ("beam", "mimo-v2-flash")
# families under their own plans, with their own tests
COMPILED = ("llama", "qwen2", "qwen3-moe")  # tests/test_tp_compile.py
GENERATE = ("llama", "gemma3", "phi3", "qwen3", "mixtral", "qwen3-moe", "gpt-oss", "llama4",
            "deepseek-v3", "mamba2", "bamba", "nemotron-h", "falcon-h1", "granite-4-h",
            "qwen3.5", "qwen3-next")  # tests/test_tp_generate.py
FSDP2 = ("llama", "mixtral")  # tests/test_tp.py, tests/test_moe_hf.py


def tiny_config(name: str | Family, **over):
    """The transformers config of family ``name``'s tiny model (``name``: in `FAMILIES`, or a
    `Family`)."""
    import transformers
    fam = FAMILIES[name] if isinstance(name, str) else name
    return getattr(transformers, fam.config)(**{**TINY, **fam.tiny, **over})


def build(name: str | Family, seed: int = 0, **over):
    """Family ``name``'s tiny model (as `tiny_config`), float32, its weights drawn from
    ``seed``."""
    import torch
    import transformers
    fam = FAMILIES[name] if isinstance(name, str) else name
    cfg = tiny_config(fam, **over)
    torch.manual_seed(seed)
    return exercise(getattr(transformers, fam.model)(cfg).float(), fam.redraw)


def exercise(model, redraw: dict):
    """``model`` with its all-zero floating tensors (biases, sinks, a router's score
    correction) drawn from N(0, 0.1) so the check exercises them, and the parameters named in
    ``redraw`` (leaf name -> (low, high)) drawn uniform."""
    import torch
    with torch.no_grad():
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and t.dim() and not t.any() and (
                    not n.endswith("inv_freq")):
                t.normal_(0, 0.1)
        for n, p in model.named_parameters():
            if n.rpartition(".")[2] in redraw:
                p.uniform_(*redraw[n.rpartition(".")[2]])
    return model


def _shipped() -> dict[tuple[str, bool], list[str]]:
    """(model_type, tied embeddings) -> the shipped ``--hf-config`` names."""
    from transformers import AutoConfig

    from commfuse.data import DATA_DIR
    names: dict[tuple[str, bool], list[str]] = {}
    for path in sorted((DATA_DIR / "hf").glob("*.json")):
        cfg = AutoConfig.from_pretrained(str(path))
        names.setdefault((cfg.model_type, bool(cfg.tie_word_embeddings)), []).append(path.stem)
    return names


def support_matrix() -> str:
    """docs/support.md's table: each family against what takes it."""
    from commfuse.models.llama import HF_TYPES
    from commfuse.sim.plan.hf_config import PLANNED_TYPES
    shipped = _shipped()
    rows = [(n, f.model_type, f.test, bool(tiny_config(n).tie_word_embeddings))
            for n, f in FAMILIES.items()]
    yes = lambda ok: "yes" if ok else "-"  # noqa: E731
    lines = ["| family | model_type | `parallelize` | `train --hf-config` | generate | `plan` "
             "| `torch.compile` | FSDP2 |", "|---|---|---|---|---|---|---|---|"]
    for name, kind, test, tied in rows:
        cfgs = [c for (k, t), cs in shipped.items() if k == kind and tied in (None, t)
                for c in cs]
        cfgs = ", ".join(f"`{c}`" for c in cfgs) or "a config.json of it"
        gen = "`commfuse generate`" + (" (own Llama)" if kind in HF_TYPES else "")
        gen += ", `model.generate` tested" if name in GENERATE else ""
        lines.append(f"| {name} | `{kind}` | yes ({test}) | {cfgs} | {gen} "
                     f"| {yes(kind in PLANNED_TYPES)} | {yes(name in COMPILED)} "
                     f"| {yes(name in FSDP2)} |")
    return "\n".join(lines) + "\n"


def sweep_section(path) -> str:
    """docs/support.md's sweep section: scripts/family_sweep.py's CSV at ``path``, each
    model type under its outcome."""
    import csv
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["status"], []).append(r)
    versions = ", ".join(sorted({r["transformers"] for r in rows}))
    lines = [f"`scripts/family_sweep.py` on transformers {versions}: {len(rows)} causal-LM "
             f"model types, each a tiny float32 model on 2 ranks under methods `none` and "
             f"`commfuse` against the unsharded model (logits, loss, every gradient).", ""]
    for status, what in (("exact", "checked exact"), ("MISMATCH", "MISMATCH"),
                         ("error", "error"), ("refused", "refused"), ("skipped", "skipped")):
        rs = by.get(status, [])
        if status == "exact":
            lines.append(f"- {what} ({len(rs)}): "
                         + ", ".join(f"`{r['model_type']}`" for r in rs))
            continue
        lines.append(f"- {what} ({len(rs)}){':' if rs else ''}")
        lines += [f"  - `{r['model_type']}`: {r['detail'].split('; ')[0]}" for r in rs]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- support-matrix: generated, do not edit -->\n", "<!-- end support-matrix -->"
SWEEP = "<!-- family-sweep: generated, do not edit -->\n", "<!-- end family-sweep -->"


def sections(docs) -> dict[tuple[str, str], str]:
    """docs/support.md's generated sections (``docs``: the docs folder): markers -> text."""
    from pathlib import Path
    return {(BEGIN, END): support_matrix(),
            SWEEP: sweep_section(Path(docs) / "support-sweep.csv")}


def write_support(path) -> None:
    """Replace each generated section of ``path`` (docs/support.md) between its markers."""
    from pathlib import Path
    doc = Path(path).read_text()
    for (begin, end), text in sections(Path(path).parent).items():
        head, rest = doc.split(begin)
        doc = head + begin + text + end + rest.split(end, 1)[1]
    Path(path).write_text(doc)


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["--write"]:
        write_support(sys.argv[2] if len(sys.argv) > 2 else "docs/support.md")
    else:
        print(support_matrix(), end="")

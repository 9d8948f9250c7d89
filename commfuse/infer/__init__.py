"""Inference: KV-cached prefill and decode of the Llama (and of transformers Mistral, Qwen2 and
Qwen3: biases, q/k norms, sliding windows), tensor-parallel over heads with the fused ops
(`commfuse.infer.model`; its cache `commfuse.infer.cache`), sampling and generation
(`commfuse.infer.loop`), checkpoints of ``commfuse train`` (``--hf-config`` runs' too) and
transformers models read back whole (`commfuse.infer.load`), and the ``commfuse generate``
command (`commfuse.infer.cli`)."""

from __future__ import annotations

from commfuse import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.infer.model": ("InferenceLlama",),
    "commfuse.infer.cache": ("KVCache",),
    "commfuse.infer.loop": ("Sampling", "Timings", "generate", "pad_prompts", "sample"),
    "commfuse.infer.load": ("load_hf", "load_llama"),
})

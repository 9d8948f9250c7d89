"""Training FLOPs per token of a transformers causal LM from its config, per architecture:
the numerator of ``commfuse train --hf-config``'s MFU.

    6 N + 12 L_attn H q T + 6 L_mamba H_m (Q (N_s + P) + 2 N_s P)

``6 N``: forward and backward of every weight a token meets once (PaLM, Chowdhery et al.
2022, appendix B): the matmuls of every layer and the output head, not the embedding; a
Mamba-2 layer's in_proj, depthwise conv1d and out_proj; a mixture-of-experts layer's router,
top-k routed experts and its shared expert (the active weights). ``12 L_attn H q T``: causal
attention's scores and weighted values over the whole sequence T (PaLM's term), for the
attention layers only. The last term is the Mamba-2 SSD scan (Dao & Gu 2024, "Transformers are
SSMs", section 6) as transformers' torch path computes it per head, per token, forward: the
chunk's C B^T scores (2 Q N_s) and their product with x (2 Q P), the chunk state B^T x
(2 N_s P) and its read-out C h (2 N_s P); times 3 for forward and backward. Q is the chunk
(at most T), N_s the state size, P the head dim, H_m the SSM heads. Norms, activations,
softmax and the inter-chunk recurrence (a small share) are not counted.
"""

from __future__ import annotations


def _attention(hf) -> tuple[int, int]:
    """(matmul weights, per-token-per-position term 12 H q) of one attention layer."""
    d, H, G = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    q = getattr(hf, "head_dim", None) or d // H
    return d * q * (2 * H + 2 * G), 12 * H * q


def _mamba(hf, d: int, H: int, P: int, G: int, N: int, K: int, Q: int, T: int) -> tuple[int, int]:
    """(weights, scan FLOPs per token) of one Mamba-2 mixer: in_proj z|x|B|C|dt, conv1d over
    x|B|C, out_proj; the SSD scan with chunk Q over T tokens, forward and backward."""
    d_in, conv = H * P, H * P + 2 * G * N
    weights = d * (d_in + conv + H) + conv * K + d_in * d
    Q = min(Q, T)
    return weights, 6 * H * (Q * (N + P) + 2 * N * P)


def _mamba_geometry(hf) -> tuple[int, ...]:
    """(H, P, G, N, K, Q) of the config's Mamba-2 mixers."""
    if hf.model_type == "bamba":
        return (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state,
                hf.mamba_d_conv, hf.mamba_chunk_size)
    if hf.model_type == "nemotron_h":
        return (hf.mamba_num_heads, hf.mamba_head_dim, hf.n_groups, hf.ssm_state_size,
                hf.conv_kernel, hf.chunk_size)
    return hf.num_heads, hf.head_dim, hf.n_groups, hf.state_size, hf.conv_kernel, hf.chunk_size


EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")  # config fields of MoE models


def num_experts(hf) -> int:
    """The routed experts of the config's sparse MoE layers (0: a dense model)."""
    return next((n for n in (getattr(hf, a, None) for a in EXPERTS) if n), 0)


def _sparse_layers(hf) -> set[int]:
    """The layers whose MLP is sparse: ``moe_layers`` where listed, else every
    ``decoder_sparse_step``-th (``interleave_moe_layer_step``) layer past
    ``first_k_dense_replace`` and not in ``mlp_only_layers``."""
    if getattr(hf, "moe_layers", None) is not None:
        return set(hf.moe_layers)
    step = getattr(hf, "decoder_sparse_step", None) or getattr(
        hf, "interleave_moe_layer_step", None) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ()) | set(
        range(getattr(hf, "first_k_dense_replace", None) or 0))
    return {i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0}


def _experts(hf) -> int:
    """The weights a token meets in one sparse layer: the router, its top-k SwiGLU experts
    and the shared expert(s)."""
    d, f = hf.hidden_size, getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    shared = (getattr(hf, "shared_expert_intermediate_size", None)
              or (getattr(hf, "n_shared_experts", None) or 0) * f
              or (hf.intermediate_size if hf.model_type.startswith("llama4") else 0))
    return d * num_experts(hf) + 3 * d * f * hf.num_experts_per_tok + 3 * d * shared


def layer_mix(hf) -> list[tuple[str, ...]]:
    """Each layer's parts: "attention", "mamba", "swiglu" (gate, up, down of
    ``intermediate_size``), "mlp" (up, down), "moe" (Nemotron-H's routed + shared experts),
    "experts" (the routed SwiGLU experts and shared experts of the other MoE models)."""
    L = hf.num_hidden_layers
    if hf.model_type == "mamba2":
        return [("mamba",)] * L
    if hf.model_type == "bamba":
        attn = set(hf.attn_layer_indices or ())
        return [("attention" if i in attn else "mamba", "swiglu") for i in range(L)]
    if hf.model_type == "nemotron_h":
        kind = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp",
                "moe": "moe"}
        return [(kind[t],) for t in hf.layers_block_type]
    if num_experts(hf):  # dense MLPs where not sparse (`_sparse_layers`)
        sparse = _sparse_layers(hf)
        return [("attention", "experts" if i in sparse else "swiglu") for i in range(L)]
    return [("attention", "swiglu")] * L  # Llama, Mistral, Qwen2, Qwen3


def matmul_weights(hf) -> int:
    """N: the weights a token meets once (the module docstring): the layers' matmuls and
    conv1d, the output head; not the embedding, norms or biases."""
    d = hf.hidden_size
    n = d * hf.vocab_size  # the output head
    for parts in layer_mix(hf):
        for part in parts:
            if part == "attention":
                n += _attention(hf)[0]
            elif part == "mamba":
                n += _mamba(hf, d, *_mamba_geometry(hf), 1)[0]
            elif part == "swiglu":
                n += 3 * d * (getattr(hf, "intermediate_size_mlp", None) or hf.intermediate_size)
            elif part == "mlp":
                n += 2 * d * hf.intermediate_size
            elif part == "experts":
                n += _experts(hf)
            else:  # moe: router, top-k routed experts (in the latent width, with its two
                # projections when set) and the shared expert, each expert an up/down pair
                e = hf.moe_latent_size or d
                n += (d * hf.n_routed_experts
                      + 2 * e * hf.num_experts_per_tok * hf.moe_intermediate_size
                      + 2 * d * hf.moe_shared_expert_intermediate_size
                      + (2 * d * e if hf.moe_latent_size else 0))
    return n


def flops_per_token(hf, seq_len: int) -> int:
    """Training FLOPs per token (the module docstring) of config ``hf`` at ``seq_len``."""
    seq = 0
    for parts in layer_mix(hf):
        if "attention" in parts:
            seq += _attention(hf)[1] * seq_len
        if "mamba" in parts:
            seq += _mamba(hf, hf.hidden_size, *_mamba_geometry(hf), seq_len)[1]
    return 6 * matmul_weights(hf) + seq

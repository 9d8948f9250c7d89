"""The ops of one training step of a Llama-style model, as data: what `simulate_step` times.

They follow the parallel plans of `commfuse.parallel` op for op (see its modules' docs), per
micro-batch of ``mb`` sequences of ``S`` tokens on one DP replica (``n = mb * S`` tokens,
``nl = n / (tp * up)`` of them on each rank between blocks):

- TPSP (tp > 1): per block, AG->GEMM q|k|v and gate|up, GEMM->RS out-proj and down
  (`commfuse.parallel.tensor`). Backward: the dual op (AG->GEMM <-> GEMM->RS) for the input
  gradient; the weight-gradient GEMMs run inside a fused all-gather (an AG->GEMM of twice the
  output width for GEMM->RS's backward; for AG->GEMM's, a second gather of its input, which
  it saved as a shard, whose GEMMs are the weight gradients).
- Ulysses (up > 1): GEMM->a2a q|k|v, a2a->GEMM out-proj; backward a2a->GEMM / GEMM->a2a
  plus local weight gradients. The MLP is local (`commfuse.parallel.ulysses`).
- ZeRO-3 DP (dp > 1): every Linear left unsharded by TP/UP (all of them without TP/UP, UP's
  MLP, the output head) gathers its weight rows fused with its GEMM, an AG->GEMM of (rows,
  in, tokens); backward the weight-gradient GEMM fused with the gradient reduce-scatter
  (GEMM->RS) and the rows gathered again fused with the input-gradient GEMMs (AG->GEMM)
  (`commfuse.parallel.data`). Under TP/UP x DP the code gathers each TP/UP weight with a
  *plain* all-gather before its op, and again in backward (`regathered`), whose gradient is a
  plain reduce-scatter: those are plain collectives here, exposed.
- Once per step: the all-reduce of the replicated parameters' gradients, one per group of
  axes (`ParallelLlama.sync_grads`): norms, embedding, the TP output head, Ulysses' weights.

Attention (QK^T and PV per head and sequence, causal) is a "gemm" of (S, head_dim, S) per
(sequence, local head): two GEMMs of that size, half of each masked; its backward is two such.
Not modelled: elementwise work (norms, RoPE, softmax, SwiGLU, loss), the embedding lookup,
the optimizer step, pipeline parallelism, activation recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.models.config import PRESETS as LLAMA_PRESETS, LlamaConfig

FUSED = ("ag_matmul", "matmul_rs", "matmul_a2a", "a2a_matmul")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")

# Model presets for planning: commfuse.models.llama's, plus Llama 2 13B. Public configs (Hugging
# Face model cards' config.json): meta-llama/Llama-2-7b-hf (hidden 4096, 32 layers, 32 heads,
# intermediate 11008, vocab 32000), meta-llama/Llama-2-13b-hf (5120, 40, 40, 13824, 32000),
# meta-llama/Meta-Llama-3-70B (8192, 80 layers, 64 heads, 8 kv heads, 28672, vocab 128256).
MODELS: dict[str, dict] = {
    **LLAMA_PRESETS,
    "13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_hidden=13824,
                max_seq_len=4096),
}


def model_config(model) -> LlamaConfig:
    """A `LlamaConfig` from itself or a name in ``MODELS`` (tiny, small, 1b, 7b, 8b, 13b, 70b)."""
    if isinstance(model, LlamaConfig):
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    return LlamaConfig(**MODELS[model])


@dataclass(frozen=True)
class StepOp:
    """One op of a step. ``kind``: a fused op (``FUSED``; ``shape`` = its (M, K, N), see
    `commfuse.sim.op_costs`), ``"gemm"`` (local: ``count`` GEMMs of ``shape`` = (m, k, n)) or a
    plain collective (``COLLECTIVES``; ``shape`` = (bytes in total,)). ``axis``: the group it
    runs on: "tp", "up", "dp", "world" or "local"."""

    name: str
    kind: str
    axis: str
    shape: tuple
    count: float = 1.0


def _linear_local(name, n, i, o, backward):
    """A Linear [o, i] on n local tokens: y = x @ W^T; backward dx and dW."""
    fwd = [StepOp(name, "gemm", "local", (n, i, o))]
    bwd = [StepOp(f"{name} dx", "gemm", "local", (n, o, i)),
           StepOp(f"{name} dW", "gemm", "local", (o, n, i))] if backward else []
    return fwd, bwd


def _linear_zero3(name, n, i, o, backward):
    """ShardedLinear: y^T = AG(W rows) @ x^T fused; backward dW = RS(dy^T @ x) fused, dx local."""
    fwd = [StepOp(name, "ag_matmul", "dp", (o, i, n))]
    bwd = [StepOp(f"{name} dx", "ag_matmul", "dp", (o, i, n)),  # rows gathered again
           StepOp(f"{name} dW", "matmul_rs", "dp", (o, n, i))] if backward else []
    return fwd, bwd


def block_ops(cfg: LlamaConfig, tp: int, up: int, dp: int, seq: int, mb: int,
              backward: bool = True, dtype_bytes: float = 2) -> tuple[list, list]:
    """(forward ops, backward ops in backward order) of one transformer block."""
    D, hd, H, G, F = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden
    qkv, o_in, n, inner = (H + 2 * G) * hd, H * hd, mb * seq, tp * up
    nl = n // inner
    attn = StepOp("attention", "gemm", "local", (seq, hd, seq), mb * H / inner)
    attn_b = StepOp("attention bwd", "gemm", "local", (seq, hd, seq), 2 * mb * H / inner)
    fwd, bwd = [], []
    lin = _linear_zero3 if dp > 1 else _linear_local
    if tp > 1:
        t = tp
        mats = {"wq": o_in // t * D, "wk": G * hd // t * D, "wv": G * hd // t * D,
                "wo": o_in // t * D, "w_gate": F // t * D, "w_up": F // t * D,
                "w_down": F // t * D}
        gathers = [StepOp(f"gather {k}", "all_gather", "dp", (v * dtype_bytes,))
                   for k, v in mats.items()] if dp > 1 else []
        fwd += gathers[:4] + [
            StepOp("q|k|v", "ag_matmul", "tp", (n, D, qkv // t)), attn,
            StepOp("out-proj", "matmul_rs", "tp", (n, o_in // t, D))] + gathers[4:] + [
            StepOp("gate|up", "ag_matmul", "tp", (n, D, 2 * F // t)),
            StepOp("down", "matmul_rs", "tp", (n, F // t, D))]
        if backward:  # dW inside a fused gather: of dY (GEMM->RS), of x again (AG->GEMM)
            regathers = [StepOp(g.name.replace("gather", "regather"), "all_gather", "dp",
                                g.shape) for g in gathers]
            bwd += regathers[4:] + [
                StepOp("down dx|dW", "ag_matmul", "tp", (n, D, 2 * F // t)),
                StepOp("gate|up dW", "ag_matmul", "tp", (n, D, 2 * F // t)),
                StepOp("gate|up dx", "matmul_rs", "tp", (n, 2 * F // t, D))] + regathers[:4] + [
                StepOp("out-proj dx|dW", "ag_matmul", "tp", (n, D, 2 * o_in // t)), attn_b,
                StepOp("q|k|v dW", "ag_matmul", "tp", (n, D, qkv // t)),
                StepOp("q|k|v dx", "matmul_rs", "tp", (n, qkv // t, D))]
            bwd += [StepOp(g.name.replace("gather", "grad RS"), "reduce_scatter", "dp", g.shape)
                    for g in gathers]
        return fwd, bwd
    if up > 1:
        gathers = [StepOp(f"gather {k}", "all_gather", "dp", (v * dtype_bytes,))
                   for k, v in (("wqkv", qkv * D), ("wo", o_in * D))] if dp > 1 else []
        fwd += gathers + [StepOp("q|k|v", "matmul_a2a", "up", (n, D, qkv)), attn,
                          StepOp("out-proj", "a2a_matmul", "up", (n, o_in, D))]
        if backward:
            bwd += [StepOp(g.name.replace("gather", "regather"), "all_gather", "dp", g.shape)
                    for g in gathers]
            bwd += [StepOp("out-proj dx", "matmul_a2a", "up", (n, D, o_in)),
                    StepOp("out-proj dW", "gemm", "local", (o_in, nl, D)), attn_b,
                    StepOp("q|k|v dx", "a2a_matmul", "up", (n, qkv, D)),
                    StepOp("q|k|v dW", "gemm", "local", (D, nl, qkv))]
            bwd += [StepOp(g.name.replace("gather", "grad RS"), "reduce_scatter", "dp", g.shape)
                    for g in gathers]
    else:
        for name, o in (("wq", o_in), ("wk", G * hd), ("wv", G * hd)):
            f, b = lin(name, nl, D, o, backward)
            fwd, bwd = fwd + f, b + bwd
        fwd.append(attn)
        bwd.insert(0, attn_b)
        f, b = lin("wo", nl, o_in, D, backward)
        fwd, bwd = fwd + f, b + bwd
    for name, i, o in (("w_gate", D, F), ("w_up", D, F), ("w_down", F, D)):  # local or ZeRO-3
        f, b = lin(name, nl, i, o, backward)
        fwd, bwd = fwd + f, b + bwd
    return fwd, bwd


def head_ops(cfg: LlamaConfig, tp: int, up: int, dp: int, seq: int, mb: int,
             backward: bool = True) -> tuple[list, list]:
    """The output head on this rank's tokens: ZeRO-3 over DP unless tied, else local."""
    nl = mb * seq // (tp * up)
    lin = _linear_zero3 if dp > 1 and not cfg.tie_embeddings else _linear_local
    return lin("output", nl, cfg.dim, cfg.vocab_size, backward)


def grad_sync_ops(cfg: LlamaConfig, tp: int, up: int, dp: int, dtype_bytes: float = 2) -> list:
    """The per-step all-reduces of replicated gradients, one per group of axes."""
    L, D, hd, V = cfg.n_layers, cfg.dim, cfg.head_dim, cfg.vocab_size
    block = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd * D + cfg.n_heads * hd * D \
        + 3 * cfg.ffn_hidden * D
    seq = tp * up
    params = [((2 * L + 1) * D, ()), (V * D, ())]  # norms, embedding (tied head included)
    if not cfg.tie_embeddings:
        params.append((V * D / dp, ("dp",)) if dp > 1 else (V * D, ()))
    sharded = ("seq",) if tp > 1 else ()
    params.append((L * block / (tp * dp), sharded + (("dp",) if dp > 1 else ())))
    buckets: dict[str, float] = {}
    for count, axes in params:
        need = [a for a, size in (("seq", seq), ("dp", dp)) if size > 1 and a not in axes]
        if need:
            key = "+".join(need)
            buckets[key] = buckets.get(key, 0.0) + count * dtype_bytes
    axis = {"seq": "tp" if tp > 1 else "up", "dp": "dp", "seq+dp": "world"}
    return [StepOp(f"grad all-reduce ({k})", "all_reduce", axis[k], (b,))
            for k, b in buckets.items()]

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

`StepModel` says which step: the current one (its defaults) or, field by field, the previous
one (`StepModel.previous()`), so both can be predicted. What the current step changes:

- ``grad_sync="bucketed"``: the all-reduces run as buckets of ``bucket_mb`` posted during the
  backward (DDP style); `commfuse.sim.step.timing` counts exposed only the last bucket, or what does
  not fit behind the backward compute. ("end": all of them after the backward, exposed.)
- ``vocab_parallel``: with tp or up > 1 the head's rows are sharded over that group (T ranks):
  the final hidden all-gathered fused with the head GEMM, [n/T, D] -> logits [n, V/T]; the
  vocab-parallel cross-entropy adds two all-reduces of [n] and [2, n] floats; backward the
  GEMM->RS of dx. The embedding's rows too: its output reduce-scattered ([n, D] in forward,
  all-gathered in backward). Neither has a gradient all-reduce over the group any more.
- ``ag_backward="regather"``: AG->GEMM's backward gathers A again fused with the weight-grad
  GEMM (an AG->GEMM of the same bytes and FLOPs) instead of saving it ("save": local GEMM).
- ``rs_backward="stream"``: GEMM->RS's backward weight-grad GEMM consumes dC's slices as the
  gather brings them: one AG->GEMM doing dx and dW per slice ("after": dW local, afterwards).

Attention (QK^T and PV per head and sequence, causal) is a "gemm" of (S, head_dim, S) per
(sequence, local head): two GEMMs of that size, half of each masked; its backward is two such.
Not modelled: elementwise work (norms, RoPE, softmax, SwiGLU, loss), the embedding lookup,
the optimizer step, pipeline parallelism, activation recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from commfuse.models.config import PRESETS as LLAMA_PRESETS, LlamaConfig
from commfuse.sim.step.arch import PRESET_FIELDS as HYBRID_PRESETS, HybridConfig

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
    **HYBRID_PRESETS,  # MoE and Mamba-2 hybrids (`commfuse.sim.step.arch`): Mixtral, Nemotron-H...
}


def model_config(model) -> LlamaConfig:
    """A `LlamaConfig` from itself or a name in ``MODELS`` (MoE, Mamba: a `HybridConfig`)."""
    if isinstance(model, LlamaConfig):
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    return (HybridConfig if model in HYBRID_PRESETS else LlamaConfig)(**MODELS[model])


LOSS_BYTES = 4  # the cross-entropy's statistics are float32 whatever the model's dtype


@dataclass(frozen=True)
class StepModel:
    """Which training step `simulate_step` times (module doc): defaults, the current one."""

    grad_sync: str = "bucketed"
    """"bucketed" (all-reduce buckets during the backward) or "end" (after it)."""
    bucket_mb: float = 25.0
    """Bucket size in MiB for "bucketed" (torch DDP's default)."""
    vocab_parallel: bool = True
    """Head and embedding rows sharded over the TP/UP group (else replicated there)."""
    ag_backward: str = "regather"
    """AG->GEMM backward: "regather" (fused AG with the weight grad) or "save" (local dW)."""
    rs_backward: str = "stream"
    """GEMM->RS backward: "stream" (dW fused into the dx gather) or "after" (local dW)."""
    regather_prefetch: bool = True
    """TP, "regather": each AG->GEMM's re-gather is posted ahead by the backward of the
    GEMM->RS after it (`commfuse.ops.prefetch`), so its transfers overlap the local compute
    between the two (`commfuse.sim.step.timing.prefetch_credit`); it runs before its dx RS."""

    def __post_init__(self):
        for name, allowed in (("grad_sync", ("bucketed", "end")),
                              ("ag_backward", ("regather", "save")),
                              ("rs_backward", ("stream", "after"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"StepModel.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"StepModel.bucket_mb must be > 0, got {self.bucket_mb!r}")

    @classmethod
    def previous(cls) -> "StepModel":
        """Sync at the end, head and embedding replicated, AG->GEMM's A saved, dW after."""
        return cls("end", 25.0, False, "save", "after", False)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


CURRENT = StepModel()


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
    attention: tuple = ()
    """A fused op's slots also run causal attention (`OpSpec.attention`); on a "gemm",
    (head_dim, order, factor): causal attention of ``shape[0]`` rows of one sequence."""
    moved: float = 1.0
    """A fused op's share of its rows that travel (`OpSpec.moved`: MoE dedup)."""


def _linear_local(name, n, i, o, backward, sm=None):
    """A Linear [o, i] on n local tokens: y = x @ W^T; backward dx and dW."""
    fwd = [StepOp(name, "gemm", "local", (n, i, o))]
    bwd = [StepOp(f"{name} dx", "gemm", "local", (n, o, i)),
           StepOp(f"{name} dW", "gemm", "local", (o, n, i))] if backward else []
    return fwd, bwd


def _linear_zero3(name, n, i, o, backward, sm: StepModel = CURRENT):
    """ShardedLinear: y^T = AG(W rows) @ x^T fused; backward dW = RS(dy^T @ x) fused, and dx on
    the saved W (local) or on W gathered again fused with it (``sm.ag_backward``)."""
    fwd = [StepOp(name, "ag_matmul", "dp", (o, i, n))]
    dx = StepOp(f"{name} dx", "ag_matmul", "dp", (o, i, n)) if sm.ag_backward == "regather" \
        else StepOp(f"{name} dx", "gemm", "local", (i, o, n))
    bwd = [StepOp(f"{name} dW", "matmul_rs", "dp", (o, n, i)), dx] if backward else []
    return fwd, bwd


def _ag_backward(name, n, k, o, axis, sm: StepModel):
    """Backward of an AG->GEMM [n/W, k] -> [n, o]: dx = RS(dy @ W^T), then dW = x^T @ dy on
    the saved x ("save") or on x gathered again slice by slice ("regather")."""
    dw = StepOp(f"{name} dW", "ag_matmul", axis, (n, k, o)) if sm.ag_backward == "regather" \
        else StepOp(f"{name} dW", "gemm", "local", (k, n, o))
    dx = StepOp(f"{name} dx", "matmul_rs", axis, (n, o, k))
    if sm.ag_backward == "regather" and sm.regather_prefetch and axis == "tp" \
            and name != "output":  # the code's order: the (prefetched) gather, then dx
        return [dw, dx]
    return [dx, dw]


def _rs_backward(name, n, k, o, axis, sm: StepModel):
    """Backward of a GEMM->RS [n, k] -> [n/W, o]: dx = AG(dy) @ W^T and dW = x^T @ AG(dy),
    dW per arriving slice in the same op ("stream": an AG->GEMM of 2k columns) or afterwards."""
    if sm.rs_backward == "stream":
        return [StepOp(f"{name} dx+dW", "ag_matmul", axis, (n, o, 2 * k))]
    return [StepOp(f"{name} dx", "ag_matmul", axis, (n, o, k)),
            StepOp(f"{name} dW", "gemm", "local", (k, n, o))]


def block_ops(cfg: LlamaConfig, tp: int, up: int, dp: int, seq: int, mb: int,
              backward: bool = True, dtype_bytes: float = 2,
              sm: StepModel = CURRENT, query_split: bool = False) -> tuple[list, list]:
    """(forward ops, backward ops in backward order) of one transformer block.
    ``query_split`` (tp > 1): the attention runs inside the out-projection's GEMM->RS
    (`tp_attention_ops`)."""
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
        attn_f, attn_bwd = tp_attention_ops(cfg, t, seq, mb, query_split, sm)
        fwd += gathers[:4] + [
            StepOp("q|k|v", "ag_matmul", "tp", (n, D, qkv // t))] + attn_f + gathers[4:] + [
            StepOp("gate|up", "ag_matmul", "tp", (n, D, 2 * F // t)),
            StepOp("down", "matmul_rs", "tp", (n, F // t, D))]
        if backward:  # the DP-gathered weights are gathered again (regather) or were kept
            regathers = [StepOp(g.name.replace("gather", "regather"), "all_gather", "dp",
                                g.shape) for g in gathers] if sm.ag_backward == "regather" else []
            bwd += (regathers[4:] + _rs_backward("down", n, F // t, D, "tp", sm)
                    + _ag_backward("gate|up", n, D, 2 * F // t, "tp", sm) + regathers[:4]
                    + attn_bwd + _ag_backward("q|k|v", n, D, qkv // t, "tp", sm))
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
            f, b = lin(name, nl, D, o, backward, sm)
            fwd, bwd = fwd + f, b + bwd
        fwd.append(attn)
        bwd.insert(0, attn_b)
        f, b = lin("wo", nl, o_in, D, backward, sm)
        fwd, bwd = fwd + f, b + bwd
    for name, i, o in (("w_gate", D, F), ("w_up", D, F), ("w_down", F, D)):  # local or ZeRO-3
        f, b = lin(name, nl, i, o, backward, sm)
        fwd, bwd = fwd + f, b + bwd
    return fwd, bwd


def tp_attention_ops(cfg: LlamaConfig, tp: int, seq: int, mb: int, query_split: bool,
                     sm: StepModel = CURRENT) -> tuple[list, list]:
    """(forward, backward) ops of TP attention and its out-projection on ``tp`` ranks.
    Row-parallel: local causal attention, then the out-projection's GEMM->RS; backward its
    dual and the attention backward. Query-split (`commfuse.ops.attention`, in the balanced
    order the TP plan runs it, `commfuse.parallel.layout.SeqLayout`): one GEMM->RS whose
    slots each also run the attention of their query rows; backward one AG->GEMM whose slots run dO, dW_o and the attention backward of
    the arriving rows (2x the forward's attention, as ``attention bwd`` here)."""
    hd, n, o_in = cfg.head_dim, mb * seq, cfg.n_heads * cfg.head_dim
    if query_split:
        return ([StepOp("attention+out-proj", "matmul_rs", "tp", (n, o_in // tp, cfg.dim),
                        attention=(hd, "balanced", 1.0, mb))],
                [StepOp("out-proj+attention bwd", "ag_matmul", "tp",
                        (n, cfg.dim, 2 * o_in // tp), attention=(hd, "balanced", 2.5, mb))])
    attn, attn_b = local_attention_ops(seq, hd, mb * cfg.n_heads / tp)
    return ([attn, StepOp("out-proj", "matmul_rs", "tp", (n, o_in // tp, cfg.dim))],
            _rs_backward("out-proj", n, o_in // tp, cfg.dim, "tp", sm) + [attn_b])


def local_attention_ops(seq: int, head_dim: int, heads: float, order: str = "contiguous",
                        name: str = "attention") -> tuple[StepOp, StepOp]:
    """(forward, backward) of causal attention over ``seq`` tokens for ``heads`` (sequence,
    head) pairs on one rank: "gemm"s of (seq, head_dim, seq), counted once per pair forward
    and twice backward, timed as the fused kernel where the hardware has an attention
    efficiency (the backward's count of two halves its 2.5x,
    `commfuse.sim.attention.BWD_FACTOR`)."""
    return (StepOp(name, "gemm", "local", (seq, head_dim, seq), heads,
                   attention=(head_dim, order, 1.0)),
            StepOp(f"{name} bwd", "gemm", "local", (seq, head_dim, seq), 2 * heads,
                   attention=(head_dim, order, 1.25)))


def _seq_axis(tp: int, up: int) -> str:
    return "tp" if tp > 1 else "up"


def head_ops(cfg: LlamaConfig, tp: int, up: int, dp: int, seq: int, mb: int,
             backward: bool = True, dtype_bytes: float = 2,
             sm: StepModel = CURRENT) -> tuple[list, list]:
    """The output head and the loss. Replicated over TP/UP: on this rank's tokens, ZeRO-3 over
    DP unless tied, else local. Vocabulary-parallel (``sm.vocab_parallel``, tp or up > 1):
    AG->GEMM of the hidden with the head's V/T rows, the loss's two all-reduces (max; sum of
    exp and target logit), backward dx by GEMM->RS; under DP the V/T rows are gathered with
    a plain all-gather (their gradient reduce-scattered), unless tied."""
    T, n, D, V = tp * up, mb * seq, cfg.dim, cfg.vocab_size
    if not (sm.vocab_parallel and T > 1):
        lin = _linear_zero3 if dp > 1 and not cfg.tie_embeddings else _linear_local
        return lin("output", n // T, D, V, backward, sm)
    ax = _seq_axis(tp, up)
    gather = [StepOp("gather output", "all_gather", "dp", (V // T * D * dtype_bytes,))] \
        if dp > 1 and not cfg.tie_embeddings else []
    fwd = gather + [StepOp("output", "ag_matmul", ax, (n, D, V // T)),
                    StepOp("loss max", "all_reduce", ax, (n * LOSS_BYTES,)),
                    StepOp("loss sum", "all_reduce", ax, (2 * n * LOSS_BYTES,))]
    bwd = _ag_backward("output", n, D, V // T, ax, sm) if backward else []
    bwd += [StepOp("grad RS output", "reduce_scatter", "dp", g.shape) for g in gather] \
        if backward else []
    return fwd, bwd


def embed_ops(cfg: LlamaConfig, tp: int, up: int, seq: int, mb: int, backward: bool = True,
              dtype_bytes: float = 2, sm: StepModel = CURRENT) -> tuple[list, list]:
    """The vocabulary-parallel embedding's collectives (``sm.vocab_parallel``, tp or up > 1):
    forward a reduce-scatter of the [n, D] lookups, backward an all-gather of their grads."""
    if not (sm.vocab_parallel and tp * up > 1):
        return [], []
    nbytes, ax = mb * seq * cfg.dim * dtype_bytes, _seq_axis(tp, up)
    return ([StepOp("embedding", "reduce_scatter", ax, (nbytes,))],
            [StepOp("embedding dx", "all_gather", ax, (nbytes,))] if backward else [])


def grad_sync_ops(cfg: LlamaConfig, tp: int, up: int, dp: int, dtype_bytes: float = 2,
                  sm: StepModel = CURRENT) -> list:
    """The per-step all-reduces of replicated gradients, one per group of axes."""
    L, D, hd, V = cfg.n_layers, cfg.dim, cfg.head_dim, cfg.vocab_size
    block = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd * D + cfg.n_heads * hd * D \
        + 3 * cfg.ffn_hidden * D
    seq = tp * up
    vocab = ("seq",) if sm.vocab_parallel and seq > 1 else ()  # rows sharded over TP/UP
    V_local = V / seq if vocab else V
    params = [((2 * L + 1) * D, ()), (V_local * D, vocab)]  # norms, embedding (tied head too)
    if not cfg.tie_embeddings:
        params.append((V_local * D / dp, vocab + ("dp",)) if dp > 1 else (V_local * D, vocab))
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


def wire_bytes(op: StepOp, world: int, dtype_bytes: float) -> float:
    """Bytes one rank sends for ``op`` on a group of ``world`` ranks, whatever the schedule
    (conventions of `commfuse.sim.costs.op_costs`): an all-gather or reduce-scatter moves
    (W-1)/W of its buffer, an all-reduce twice that, an all-to-all (W-1)/W^2 (times the
    op's ``moved``); GEMMs none."""
    if world <= 1 or op.kind == "gemm":
        return 0.0
    part = (world - 1) / world * op.count
    if op.kind not in FUSED:
        return part * op.shape[0] * (2 if op.kind == "all_reduce" else 1)
    M, K, N = op.shape
    moved = {"ag_matmul": M * K, "matmul_rs": M * N, "matmul_a2a": M * N / world,
             "a2a_matmul": M * K / world}[op.kind]
    return part * moved * op.moved * dtype_bytes

"""The work of a training step besides the GEMMs and collectives of `commfuse.sim.step.ops`:
memory-bound kernels, fused attention, activation recompute and the optimizer, as data.

Pure (no torch). Counts are per rank and per micro-batch of ``mb`` sequences of ``S`` tokens,
``nl = mb * S / (tp * up)`` tokens on the rank between blocks; ``a`` is the activations' bytes
per element (bf16: 2), ``f = 4`` the bytes of the float32 intermediates.

**Memory-bound work** is timed by the bytes it moves over the preset's memory bandwidth
(`Hardware.mem_bandwidth` x `Hardware.mem_efficiency`). The bytes are counted kernel by
kernel for the eager Llama block that torchtitan and `commfuse.models.llama` run (RMSNorm in
float32, RoPE by complex multiplication in float32, repeat_kv copies for grouped-query
attention, SwiGLU as silu then mul, residual adds); each kernel reads its inputs and writes
its output once (`block_elementwise_bytes`), and likewise the kernels eager autograd runs for
their backward (`block_elementwise_bytes(..., backward=True)`: each reads the output gradient
and the saved inputs and writes the input gradients, plus the sums of gradients where a
tensor feeds two ops; about 1.8 times the forward's bytes for a Llama block). Under TP/UP
every such tensor is sharded over the T = tp * up ranks (sequence or heads), so a rank moves
``nl`` tokens' worth.

**Activation checkpointing** (``ac``), per block, as torchtitan applies it
(torchtitan/parallelisms/parallelize_llama.py, `_apply_ac_to_transformer_block`):

- ``"none"``: nothing recomputed; autograd keeps what each op saves (`block_saved_bytes`).
- ``"selective"`` (torchtitan's op policy): the outputs of attention and of every *odd* matmul
  in forward order are saved (q, v, gate, down for a Llama block), every *second* matmul (k,
  out-proj, up) and every elementwise kernel is recomputed in the backward.
- ``"full"``: only the block's input is saved; the whole forward runs again in the backward
  (its collectives too).

**Attention** runs as a fused (flash) kernel: forward 4 * S^2 * head_dim / 2 FLOPs per head and
sequence (causal), backward 2.5 times that (`ATTN_BWD_FLOPS`: FlashAttention's backward
recomputes QK^T, 5 GEMMs to the forward's 2), at `Hardware.attention_efficiency` of the peak.

**Optimizer**: AdamW as torch's foreach implementation runs it on float32 states, plus gradient
norm clipping: `OPTIMIZER_BYTES` per parameter on the rank.

**Layers of other kinds** (a `commfuse.sim.step.arch.HybridConfig`): `elementwise_bytes`,
`scan_time`, `saved_bytes`, `recomputed_gemms` and `rank_weights` give one layer of each kind
(the "block" kind is exactly the Llama block's numbers above), per token on a rank between
layers; under TP a sub-layer's tensors are sharded over the T = tp * up ranks (sequence or
channels), so a rank moves ``nl`` tokens' worth, as there.

- Attention (``*``) and MLP (``-``) sub-layers: the two halves of the Llama block's count,
  each with one pre-norm and one residual add.
- MoE (``E``): the router's float32 softmax and top-k over E, then as
  `commfuse.sim.moe.layer_ops` counts the expert-parallel layer kernel by kernel, in bytes
  per element of the ``top_k`` rows: the rows' gather (2 per element of D), the experts'
  SwiGLU (5 per element of F_e), the weighted sum (6.5 per element of D); backward the
  weighted sum's (9) and the scatter-add of the rows (3) over D, the SwiGLU's (13) over
  F_e; the shared experts' SwiGLU as the MLP's.
- Mamba-2 (``M``): the conv1d (fused with its silu: x | B | C read and written once), dt's
  softplus, the gated group RMSNorm (y and z in, float32 statistics, out); its backward
  twice the forward's bytes. The **scan** is timed separately (`scan_time`): the larger of
  its bytes over the memory bandwidth (x, B, C, dt in, y out, the float32 chunk states
  written and read) and its FLOPs (`commfuse.sim.step.arch.scan_flops`, the SSD count) at
  `VECTOR_SHARE` of the GEMM peak. That rate is the H100 SXM datasheet's FP32 non-tensor
  67 TFLOP/s over its 989 TFLOP/s dense BF16, applied to every preset: the SSD kernel runs
  its chunk products on tensor cores, so this is an upper bound on the scan's time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from commfuse.sim.step.arch import matmul_weights, scan_flops

F32 = 4
ATTN_BWD_FLOPS = 2.5
# torch.optim.AdamW(foreach=True) (torch/optim/adamw.py, _multi_tensor_adamw) per float32
# parameter, each kernel reading its inputs and writing its output once: param *= 1 - lr*wd
# (8), exp_avg.lerp_(grad) (12), exp_avg_sq *= beta2 (8), exp_avg_sq += (1-beta2) grad*grad
# (16), sqrt (8), / bias correction (8), + eps (8), param.addcdiv_(exp_avg, denom) (16); then
# clip_grad_norm_: the norm (4) and the scaling (8).
OPTIMIZER_BYTES = 8 + 12 + 8 + 16 + 8 + 8 + 8 + 16 + 4 + 8
# The cross-entropy on float32 logits, per logit: cast (2+4), log_softmax (read twice, write:
# 12), nll backward (zero-fill: 4), log_softmax backward (read grad twice and output, write:
# 16), cast back (4+2).
LOSS_BYTES_PER_LOGIT = 6 + 12 + 4 + 16 + 6
AC_MODES = ("none", "selective", "full")
VECTOR_SHARE = 67 / 989  # the scan's FLOP rate over the GEMM peak (module doc)


@dataclass(frozen=True)
class TrainSetup:
    """How the training step runs, beyond the layout: what `simulate_train_step` and
    `commfuse.sim.step.memory` assume. Defaults: torchtitan's Llama 3 recipe (bf16 mixed precision
    with float32 master weights, AdamW, FSDP2)."""

    ac: str = "selective"
    """Activation checkpointing per block: "none", "selective" (torchtitan's op policy) or
    "full" (module doc)."""
    fsdp: bool = True
    """DP runs as torch FSDP2 (torchtitan): every parameter (embedding and norms too) sharded
    over DP; method "none" gathers each block's weights ahead (the next block's all-gather
    behind this block's compute, its reduce-scatter behind the previous block's backward) and
    keeps the root's (embedding, head) gathered from forward to backward. False: as
    `commfuse.parallel.data` runs (norms and embedding replicated, no prefetch)."""
    param_bytes: float = 4
    """Bytes per master parameter kept on the rank (float32)."""
    grad_bytes: float = 4
    """Bytes per gradient element kept and reduce-scattered (FSDP2 reduce_dtype float32)."""
    optimizer_bytes: float = 8
    """Optimizer state bytes per parameter (AdamW: two float32 moments)."""

    def __post_init__(self):
        if self.ac not in AC_MODES:
            raise ValueError(f"TrainSetup.ac must be one of {AC_MODES}, got {self.ac!r}")
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TrainSetup.{name} must be >= 0, got {getattr(self, name)!r}")

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def block_linears(cfg) -> list[tuple[str, int, int]]:
    """(name, in, out) of a block's Linears in forward order (the order torchtitan's selective
    policy counts matmuls in): wq, wk, wv, wo, w_gate (w1), w_up (w3), w_down (w2)."""
    D, hd, H, G, F = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden
    return [("wq", D, H * hd), ("wk", D, G * hd), ("wv", D, G * hd), ("wo", H * hd, D),
            ("w_gate", D, F), ("w_up", D, F), ("w_down", F, D)]


def recomputed_linears(cfg, ac: str) -> list[tuple[str, int, int]]:
    """The Linears whose forward GEMM runs again in the backward under ``ac``."""
    lin = block_linears(cfg)
    return {"none": [], "selective": lin[1::2], "full": lin}[ac]


def block_width_bytes(cfg, a: float = 2, backward: bool = False) -> float:
    """The part of `block_elementwise_bytes` over the model width D: the two RMSNorms and
    the two residual adds (what a rank runs on its own rows, where the rest is on its
    heads' and FFN shard's columns of every row)."""
    f = F32
    if not backward:
        norm = (a + f) + 2 * f + f + 2 * f + (f + a) + 2 * a  # cast, pow, mean, *, cast, *w
    else:
        # RMSNorm: d(n*w) -> dn (2a) and dw (g*n, then the sum over tokens: 4a); the casts
        # (a+f each); d(x*r) -> dx (2f) and dr (g*x, then the sum over D: 4f); d mean (f);
        # d pow (2x: 2f, then *g: 3f); the two paths into x summed (3f)
        norm = 2 * a + 4 * a + 2 * (a + f) + 2 * f + 4 * f + f + 2 * f + 3 * f + 3 * f
    return (2 * norm + 2 * 3 * a) * cfg.dim  # two RMSNorms, two residual adds (grad sums)


def block_elementwise_bytes(cfg, a: float = 2, backward: bool = False) -> float:
    """Bytes the memory-bound kernels of one block's forward (or, ``backward``, of its
    backward) move per token (module doc)."""
    G, F = cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    Hd = cfg.n_heads * cfg.head_dim
    f = F32
    if not backward:
        rope = (a + f) + 2 * f + (f + a)  # cast, complex mul, cast back; per element
        swiglu = 2 * a + 3 * a  # silu, mul
    else:
        rope = (a + f) + 2 * f + (f + a)  # cast, mul by conj(freqs), cast
        swiglu = 3 * a + 3 * a + 3 * a  # d(silu*up) -> two muls; silu's backward
    repeat = 2 * a * (G + Hd) if G < Hd else 0  # k and v expanded (backward: summed back)
    return (block_width_bytes(cfg, a, backward)
            + rope * (Hd + G) + repeat
            + 2 * a * Hd  # attention output transposed back, contiguous
            + swiglu * F)


def block_saved_bytes(cfg, ac: str, a: float = 2) -> float:
    """Bytes one block keeps for its backward per token, between its forward and backward."""
    D, G, F = cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    Hd = cfg.n_heads * cfg.head_dim
    lse = F32 * cfg.n_heads  # attention's float32 logsumexp, per token and head
    if ac == "full":
        return a * D  # the block's input
    if ac == "selective":  # input, outputs of q, v, gate, down and of attention (+ its lse)
        return a * D + a * Hd + a * G + a * Hd + lse + a * F + a * D
    # none: each norm its float32 input and normed output; RoPE's float32 q, k; attention's
    # q, k, v (k, v expanded to every head), output and lse; out-proj's input; SwiGLU's gate,
    # up and silu outputs; down's input
    return 2 * (F32 + a) * D + F32 * (Hd + G) + 4 * a * Hd + lse + a * Hd + 4 * a * F


def attention_flops(cfg, seq: int, mb: int, T: int) -> float:
    """Forward FLOPs of one block's causal attention on one rank (heads over T ranks)."""
    return 4.0 * seq * seq * cfg.head_dim / 2 * cfg.n_heads * mb / T


def attention_times(hw, cfg, seq: int, mb: int, T: int) -> tuple[float, float]:
    """(forward, backward) seconds of one block's fused attention on one rank, or None where
    ``hw`` has no attention efficiency (time it as the step's GEMMs)."""
    ef, eb = hw.attention_efficiency
    if not (ef and eb):
        return None
    flops, keys = attention_flops(cfg, seq, mb, T), (seq + 1) / 2
    # one kernel call over the whole sequence's query rows (TP: its heads; UP: after the a2a)
    return (hw.attention_time(flops, keys, rows_per_call=seq),
            hw.attention_time(ATTN_BWD_FLOPS * flops, keys, backward=True, rows_per_call=seq))


def mem_time(hw, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through memory on ``hw``."""
    return nbytes / (hw.mem_bandwidth * hw.mem_efficiency)


def local_gemm(name: str, i: int, o: int, n: int, tp: int, up: int) -> tuple:
    """The (m, k, n) GEMM one rank runs for Linear ``name`` [o, i] on a micro-batch of ``n``
    tokens: TP shards the columns (q, k, v, gate, up) or rows (out-proj, down) over tp ranks on
    all n tokens; otherwise each rank has n / (tp * up) tokens."""
    if tp > 1:
        return (n, i // tp, o) if name in ("wo", "w_down") else (n, i, o // tp)
    return (n // up, i, o)


def _norm_add(cfg, a: float, backward: bool) -> float:
    """One RMSNorm and one residual add per token: half of the block's width bytes."""
    return block_width_bytes(cfg, a, backward) / 2


def elementwise_bytes(cfg, kind: str, a: float = 2, backward: bool = False) -> float:
    """Bytes the memory-bound kernels of one layer of ``kind`` move per token (module doc);
    the scan is `scan_time`'s."""
    if kind == "block":
        return block_elementwise_bytes(cfg, a, backward)
    D = cfg.dim
    G, Hd, F = cfg.n_kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.ffn_hidden
    swiglu = 9 * a if backward else 5 * a
    if kind == "*":
        rope = (a + F32) + 2 * F32 + (F32 + a)
        repeat = 2 * a * (G + Hd) if G < Hd else 0
        return _norm_add(cfg, a, backward) + rope * (Hd + G) + repeat + 2 * a * Hd
    if kind == "-":
        return _norm_add(cfg, a, backward) + swiglu * F
    if kind == "E":  # as commfuse.sim.moe.layer_ops counts the EP layer's elementwise work
        m = cfg.moe
        k, E, kF = m.top_k, m.experts, m.top_k * m.expert_ffn
        moe = 3 * F32 * E + (12 * k * D + 13 * kF if backward else 8.5 * k * D + 5 * kF) * a
        return _norm_add(cfg, a, backward) + moe + swiglu * m.shared_ffn
    m = cfg.mamba  # "M"
    fwd = 2 * m.conv_dim * a + 2 * m.heads * F32 + 3 * m.d_inner * a + 2 * m.d_inner * F32
    return _norm_add(cfg, a, backward) + fwd * (2 if backward else 1)


def scan_time(hw, cfg, seq: int, tokens: float, T: int, a: float = 2,
              backward: bool = False) -> float:
    """Seconds of one Mamba layer's scan over ``tokens`` tokens of ``seq``-long sequences on
    a rank whose heads are 1/T of them (module doc); backward: twice the forward."""
    m = cfg.mamba
    per_token = (2 * m.d_inner + 2 * m.n_groups * m.d_state) * a + m.heads * F32 \
        + 2 * m.heads * m.head_dim * m.d_state * F32 / min(m.chunk, seq)
    rate = hw.gemm_flops * hw.clock_factor() * VECTOR_SHARE
    t = max(mem_time(hw, per_token * tokens / T), scan_flops(m, seq) * tokens / T / rate)
    return 2 * t if backward else t


def saved_bytes(cfg, kind: str, ac: str, a: float = 2) -> float:
    """Bytes one layer of ``kind`` keeps for its backward per token under ``ac``."""
    if kind == "block":
        return block_saved_bytes(cfg, ac, a)
    D = cfg.dim
    G, Hd, F = cfg.n_kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.ffn_hidden
    if ac == "full":
        return a * D  # the layer's input
    if kind == "*":
        lse = F32 * cfg.n_heads
        if ac == "selective":  # input, q, v, attention's output and lse
            return a * D + 2 * a * Hd + a * G + lse
        return (F32 + a) * D + F32 * (Hd + G) + 5 * a * Hd + lse
    if kind == "-":
        return a * D + a * F if ac == "selective" else (F32 + a) * D + 4 * a * F
    if kind == "E":
        m = cfg.moe
        k = m.top_k
        if ac == "selective":  # input, router logits, gate outputs, down's output
            return a * D + F32 * m.experts + a * k * m.expert_ffn + a * k * D + a * m.shared_ffn
        return ((F32 + a) * D + F32 * m.experts + 2 * k * D * a + 4 * a * k * m.expert_ffn
                + 4 * a * m.shared_ffn)
    m = cfg.mamba  # "M"
    if ac == "selective":  # input, in_proj's output, y into out_proj
        return a * D + a * m.in_proj_out + a * m.d_inner
    return (F32 + a) * D + a * m.in_proj_out + a * m.conv_dim + 3 * a * m.d_inner


def recomputed_gemms(cfg, kind: str, tp: int, up: int, ep: int, n: int) -> list[tuple]:
    """(m, k, n) of the GEMMs one layer of ``kind`` runs again under selective AC (every
    second matmul in forward order, torchtitan's policy) for ``n`` tokens per micro-batch."""
    if kind == "block":
        return [local_gemm(nm, i, o, n, tp, up)
                for nm, i, o in recomputed_linears(cfg, "selective")]
    lin = block_linears(cfg)
    if kind == "*":
        return [local_gemm(nm, i, o, n, tp, up) for nm, i, o in lin[:4][1::2]]
    if kind == "-":
        return [local_gemm(nm, i, o, n, tp, up) for nm, i, o in lin[4:][1::2]]
    nl = n // (tp * up)
    if kind == "E":  # router, experts' gate, up, down: the gate... every second: up and down
        m = cfg.moe
        return [(nl * m.top_k, cfg.dim, m.expert_ffn), (nl * m.top_k, m.expert_ffn, cfg.dim)]
    m = cfg.mamba  # in_proj, out_proj: out_proj
    if tp > 1:
        return [(n, m.d_inner // tp, cfg.dim)]
    return [(nl, m.d_inner, cfg.dim)]


def rank_weights(cfg, kind: str, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) matmul weights of one layer of ``kind`` on a rank before DP sharding:
    dense ones over tp (the router is replicated), routed experts E/ep of them."""
    if kind == "block":
        return sum(i * o for _, i, o in block_linears(cfg)) / tp, 0.0
    dense, expert = matmul_weights(cfg, kind)
    if kind == "E":
        router = cfg.dim * cfg.moe.experts
        return (dense - router) / tp + router, expert / ep
    return dense / tp, 0.0

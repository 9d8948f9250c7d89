"""What one layer of each kind costs besides its GEMMs and collectives: the memory-bound
bytes, the Mamba-2 scan, the activations kept for the backward, the recomputed GEMMs and the
weights a rank holds, as `commfuse.sim.work` counts them for the Llama block (the "block"
kind here is exactly that module's numbers).

Pure (no torch). Per token on a rank between layers (``nl`` of them per micro-batch), with
``a`` bytes per activation element and ``f = 4`` per float32 intermediate; under TP a
sub-layer's tensors are sharded over the T = tp * up ranks (sequence or channels), so a rank
moves ``nl`` tokens' worth, as there.

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
  written and read) and its FLOPs (`commfuse.sim.arch.scan_flops`, the SSD count) at
  `VECTOR_SHARE` of the GEMM peak. That rate is the H100 SXM datasheet's FP32 non-tensor
  67 TFLOP/s over its 989 TFLOP/s dense BF16, applied to every preset: the SSD kernel runs
  its chunk products on tensor cores, so this is an upper bound on the scan's time.
"""

from __future__ import annotations

from commfuse.sim import work
from commfuse.sim.arch import matmul_weights, scan_flops

F32 = work.F32
VECTOR_SHARE = 67 / 989


def _norm_add(cfg, a: float, backward: bool) -> float:
    """One RMSNorm and one residual add per token: half of the block's width bytes."""
    return work.block_width_bytes(cfg, a, backward) / 2


def elementwise_bytes(cfg, kind: str, a: float = 2, backward: bool = False) -> float:
    """Bytes the memory-bound kernels of one layer of ``kind`` move per token (module doc);
    the scan is `scan_time`'s."""
    if kind == "block":
        return work.block_elementwise_bytes(cfg, a, backward)
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
    t = max(work.mem_time(hw, per_token * tokens / T), scan_flops(m, seq) * tokens / T / rate)
    return 2 * t if backward else t


def saved_bytes(cfg, kind: str, ac: str, a: float = 2) -> float:
    """Bytes one layer of ``kind`` keeps for its backward per token under ``ac``."""
    if kind == "block":
        return work.block_saved_bytes(cfg, ac, a)
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
        return [work.local_gemm(nm, i, o, n, tp, up)
                for nm, i, o in work.recomputed_linears(cfg, "selective")]
    lin = work.block_linears(cfg)
    if kind == "*":
        return [work.local_gemm(nm, i, o, n, tp, up) for nm, i, o in lin[:4][1::2]]
    if kind == "-":
        return [work.local_gemm(nm, i, o, n, tp, up) for nm, i, o in lin[4:][1::2]]
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
        return sum(i * o for _, i, o in work.block_linears(cfg)) / tp, 0.0
    dense, expert = matmul_weights(cfg, kind)
    if kind == "E":
        router = cfg.dim * cfg.moe.experts
        return (dense - router) / tp + router, expert / ep
    return dense / tp, 0.0

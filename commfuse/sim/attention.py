"""TP attention on the simulator: row-parallel Flash-RS and query-split, as `commfuse bench`'s
``attn_row`` / ``attn_qsplit`` run them, forward and backward.

Query-split is a GEMM -> RS (out-projection) whose every slot also computes the causal
attention of its query rows (``OpSpec.attention``): a slot's cost depends on which rows it
holds, so contiguous slots cost unequal amounts at each ring step and balanced ones
(`commfuse.schedule.balanced_split`) the same. Its backward is the dual AG -> GEMM whose
slots run dO = dOut @ W_o^T, dW_o and the attention backward of the arriving rows.

Attention of n query rows that see K keys in all, per head of dim d: 4 d K FLOPs (QK^T and
PV) at the preset's fused-attention efficiency (`Hardware.attention_time`), or where it has
none the two GEMMs, each `Hardware.gemm_time(n, d, K / n)`; the backward ``BWD_FACTOR`` times
that (flash attention's backward: recomputed scores, dV, dP, dQ, dK).
"""

from __future__ import annotations

from commfuse.schedule import balanced_split, even_sizes
from commfuse.sim.costs import OpSpec

BWD_FACTOR = 2.5
HEAD_DIM = 64


def attention_s(hw, positions, heads: float, head_dim: int, factor: float = 1.0,
                rank: int = 0) -> float:
    """Seconds of causal attention for query rows at ``positions`` (0-based), ``heads`` heads."""
    n = len(positions)
    if not n:
        return 0.0
    keys = sum(positions) + n  # row p sees p + 1 keys
    if hw.attention_efficiency[0]:  # a fused kernel: QK^T and PV, 2 FLOPs a multiply-add
        runs = 1 + sum(b != a + 1 for a, b in zip(positions, positions[1:]))  # calls' rows
        return hw.attention_time(4 * factor * heads * head_dim * keys, keys / n,
                                 backward=factor > 1, rank=rank, rows_per_call=n / runs)
    return 2 * factor * heads * hw.gemm_time(n, head_dim, keys / n, rank=rank)


def slot_positions(spec: OpSpec, world: int, slot: int, pieces: int) -> list[int]:
    """The query rows of ``slot`` (a P2P slot p*m+j; chunk ``slot`` of every slice when the
    schedule cuts ``pieces`` > 0 chunks: none / sliced) for a spec with ``attention =
    (head_dim, order, factor)``."""

    S, order = int(spec.shape[0]) // _batch(spec), spec.attention[1]
    if order == "balanced":
        sizes, pos = balanced_split(S, world)
    else:
        sizes, pos = even_sizes(S, world), list(range(S))
    starts = [sum(sizes[:p]) for p in range(world)]
    if pieces:
        out = []
        for p in range(world):
            cut = even_sizes(sizes[p], pieces)
            a = starts[p] + sum(cut[:slot])
            out += pos[a:a + cut[slot]]
        return out
    p, j = divmod(slot, spec.splits)
    cut = even_sizes(sizes[p], spec.splits)
    a = starts[p] + sum(cut[:j])
    return pos[a:a + cut[j]]


def slot_attention_s(hw, spec: OpSpec, world: int, slot: int, pieces: int, rank: int) -> float:
    """The attention one Compute step of ``spec`` adds (0 without ``spec.attention``)."""
    if not spec.attention:
        return 0.0
    head_dim, _, factor = spec.attention[:3]
    width = spec.shape[1] if spec.op == "matmul_rs" else spec.shape[2] / 2  # X (dO | dW_o)
    return attention_s(hw, slot_positions(spec, world, slot, pieces),
                       _batch(spec) * width / head_dim, head_dim, factor, rank)


def _batch(spec: OpSpec) -> int:
    """The sequences of an attention spec (its rows M are batch x sequence)."""
    return int(spec.attention[3]) if len(spec.attention) > 3 else 1


def layer_specs(workload: str, method: str, world: int, seq: int, d: int, backward: bool,
                **opts) -> list[OpSpec]:
    """The ops of ``attn_row`` / ``attn_qsplit`` (`commfuse.bench.workloads`) on one rank's
    head group (X = d / W columns of q, k, v), forward then backward."""
    X = d // world
    qkv = OpSpec("ag_matmul", method, (seq, d, 3 * X), **opts)
    if workload == "attn_row":
        fwd = [qkv, OpSpec("attention", "local", (seq, X, 1)),
               OpSpec("matmul_rs", method, (seq, X, d), **opts)]
        bwd = [OpSpec("ag_matmul", method, (seq, d, 2 * X), **opts),  # dO | dW_o per slot
               OpSpec("attention", "local", (seq, X, BWD_FACTOR))]
    elif workload == "attn_qsplit":
        fwd = [qkv, OpSpec("matmul_rs", method, (seq, X, d), attention=(HEAD_DIM, "balanced", 1.0),
                           **opts)]
        bwd = [OpSpec("ag_matmul", method, (seq, d, 2 * X),
                      attention=(HEAD_DIM, "balanced", BWD_FACTOR), **opts)]
    else:
        raise ValueError(f"not a TP attention workload: {workload!r}")
    # q|k|v backward: A gathered again feeding dW, then dx = RS(dY @ W^T)
    bwd += [OpSpec("ag_matmul", method, (seq, d, 3 * X), **opts),
            OpSpec("matmul_rs", method, (seq, 3 * X, d), **opts)]
    return fwd + bwd if backward else fwd


def local_attention_s(hw, spec: OpSpec, rank: int = 0) -> float:
    """An ``OpSpec("attention", "local", (S, X, factor))``: causal attention of the whole
    sequence on X / HEAD_DIM heads."""
    S, X, factor = spec.shape
    return attention_s(hw, range(int(S)), X / HEAD_DIM, HEAD_DIM, factor, rank)

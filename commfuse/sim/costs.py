"""What each slot of an op's schedule costs: its GEMM's dims and the bytes it moves.

Kept beside the engine so the cut of every op matches the bindings of `commfuse.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    """One op invocation: ``shape`` = (M, K, N) of the full logical GEMM (see `op_costs`)."""

    op: str
    method: str
    shape: tuple
    topology: str = "ring"
    chunks: int = 4
    splits: int = 1
    attention: tuple = ()
    """(head_dim, order, factor[, batch]): every Compute slot also runs causal attention of its
    query rows, ``factor`` times the forward's, for each of ``batch`` sequences (default 1;
    M = batch x sequence) (query-split, `commfuse.sim.attention`); () none."""
    moved: float = 1.0
    """The share of the GEMM's rows that the transfers carry: an all-to-all op of the
    deduplicated MoE dispatch moves one row per (token, destination rank), its GEMM one per
    (token, expert) (`commfuse.sim.routing.expected_ranks` / top_k); 1 elsewhere."""


@dataclass(frozen=True)
class Costs:
    """What one slot of a schedule costs: its GEMM dims, the bytes of one P2P transfer and of
    one Reduce term, and the collective's kind and total bytes per chunk."""

    gemm: tuple
    transfer_bytes: float
    reduce_bytes: float
    collective: str
    collective_bytes: float


def op_costs(spec: OpSpec, world: int, slots: int, dtype_bytes: float) -> Costs:
    """Per-slot costs, with the ops' bindings' cuts. (M, K, N) conventions, per rank:

    - ag_matmul:  holds A [M/W, K], B [K, N]; gathers A [M, K], computes [M, N].
    - matmul_rs:  holds A [M, K], B [K, N]; computes [M, N], keeps its reduced [M/W, N].
    - matmul_a2a: holds A [M/W, K] (its sequence slice), B [K, N]; computes [M/W, N] and sends
      column block p ([M/W, N/W]) to rank p; ends with [M, N/W] (all the sequence, its heads).
    - a2a_matmul: holds A [M, K/W] (all the sequence, its heads); exchanges to [M/W, K] and
      computes [M/W, N]; under P2P, block q ([M/W, K/W]) meets B's rows of head group q.

    P2P methods (``slots`` = W*m): a slot is a W*m-th of the gathered/scattered dim M.
    none/sliced (``slots`` = chunks): a chunk is 1/chunks of every rank's slice.
    The bytes are scaled by ``spec.moved`` (the deduplicated MoE dispatch).
    """
    op, (M, K, N), w, d = spec.op, spec.shape, world, dtype_bytes
    c = _costs(op, spec.method, M, K, N, w, slots, d)
    if spec.moved == 1.0:
        return c
    return Costs(c.gemm, c.transfer_bytes * spec.moved, c.reduce_bytes, c.collective,
                 c.collective_bytes * spec.moved)


def _costs(op, method, M, K, N, w, slots, d) -> Costs:
    if method in ("none", "sliced"):
        c = slots
        if op == "ag_matmul":
            return Costs((M / c, K, N), 0, 0, "all_gather", M / c * K * d)
        if op == "matmul_rs":
            return Costs((M / c, K, N), 0, 0, "reduce_scatter", M / c * N * d)
        if op == "matmul_a2a":
            return Costs((M / (w * c), K, N), 0, 0, "all_to_all", M / (w * c) * N * d)
        return Costs((M / (w * c), K, N), 0, 0, "all_to_all", M / (w * c) * K * d)
    rows = M / slots
    if op == "ag_matmul":
        return Costs((rows, K, N), rows * K * d, 0, "", 0)
    if op == "matmul_rs":
        return Costs((rows, K, N), rows * N * d, rows * N * d, "", 0)
    if op == "matmul_a2a":
        return Costs((rows, K, N / w), rows * N / w * d, 0, "", 0)
    return Costs((rows, K / w, N), rows * K / w * d, 0, "", 0)

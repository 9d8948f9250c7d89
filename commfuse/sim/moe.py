"""Mixture-of-Experts expert parallelism on the simulator: the dispatch / combine schedules of
`commfuse.schedule.moe` timed with their per-peer bytes, an EP layer forward and backward,
and ``auto``'s choice for the MoE ops (`choose`).

Pure (no torch). The counts are an `ExpertCounts` table (rows each rank routes to each
expert), the one the ops run with, so every rank's program is its own: a skewed router gives
each rank other GEMMs and other messages, and all W ranks are simulated (no symmetry).

Costs, per rank, on a `Hardware`:

- a ``Compute`` of a slot (or chunk, or piece): one GEMM per local expert over that slot's
  rows of it, ``gemm_time(rows_e, K, N)`` (the grouped GEMM's groups); the dispatch's own
  slot also copies its rows into the receive layout;
- ``Compute(TAIL)`` (``tail=True``, the backward): the weight grads, one
  ``gemm_time(K, rows_e, N)`` per local expert over all its rows, with the copy that gathers
  an expert's rows from several sources;
- a P2P transfer: its rows times the row width (dispatch: K, the rows sent; combine: N, the
  rows computed) times the dtype's bytes, drained by the engine's fluid link model;
- a ``none`` / ``sliced`` all-to-all of a chunk: ``(W - 1) * link_latency + B / bandwidth``
  over ``collective_efficiency``, B the most bytes any rank sends or receives off-rank in it
  (the even case is `Hardware.collective_time`'s ring all-to-all);
- host costs per ``Post`` / ``Collective`` as for every op (`commfuse.sim.program`).

`moe_layer_time` is the layer `commfuse.moe.parallel.ExpertParallelMoE` runs (and the ``moe``
workload of ``commfuse bench``): router, count exchange, dispatch -> gate|up, SwiGLU,
down -> combine, the weighted sum; backward the duals with their weight grads as tails.
Elementwise work is timed by its bytes at ``mem_bandwidth`` x ``mem_efficiency``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commfuse.schedule import Collective, Compute, Post, Reduce, Wait, WaitCollective
from commfuse.schedule.moe import TAIL, ExpertCounts, build, clip, piece
from commfuse.sim.engine import Engine
from commfuse.sim.hardware import Hardware
from commfuse.sim.hardware import resolve as resolve_hw
from commfuse.sim.routing import ROUTINGS, counts_of, route_tokens, routing_counts

__all__ = ["CANDIDATES", "ROUTINGS", "MoEOp", "MoESim", "choose", "counts_of", "fastest",
           "layer_ops", "moe_layer_time", "moe_op_time", "representative", "route_tokens",
           "routing_counts", "simulate_moe"]

# auto's candidates for the MoE ops, in order of preference at equal predicted time. No
# commfuse with 8 pieces: the model gives it about 1 % over 4 pieces on the testbed's sizes,
# less than its error, while each piece's receive costs a thread hand-off that the step
# charge undercounts on a loaded CPU
CANDIDATES = (("none", {}), ("commfuse", {"splits": 1}), ("commfuse", {"splits": 2}),
              ("commfuse", {"splits": 4}), ("sliced", {"chunks": 4}))


@dataclass(frozen=True)
class MoEOp:
    """One MoE op call on the simulator: ``op`` ("moe_dispatch" / "moe_combine") with
    per-expert weights [K, N] under ``method`` (``chunks`` for sliced, ``splits`` for
    commfuse); ``tail``: its weight grads run as the schedule's tail (the backward's duals).
    ``op="work"`` is local work of ``seconds`` on every rank (``per_rank`` overrides it)."""

    op: str
    method: str = "none"
    K: int = 0
    N: int = 0
    chunks: int = 4
    splits: int = 1
    tail: bool = False
    seconds: float = 0.0
    per_rank: tuple = ()
    label: str = ""


@dataclass(frozen=True)
class MoESim:
    """Predicted seconds: the slowest rank's finish, compute alone (no transfers), each
    rank's finish."""

    total_s: float
    compute_s: float
    rank_s: tuple


def simulate_moe(ops, counts: ExpertCounts, hw, dtype_bytes: float = 4,
                 step_s: float = 0.0) -> MoESim:
    """Run the `MoEOp`s back to back on every rank of ``counts``' group and time them on
    ``hw`` (a `Hardware` or a preset name); ``step_s`` of host time added per schedule step
    (`commfuse.sim.choose.STEP_OVERHEAD_S`)."""
    hw = resolve_hw(hw)
    ops = list(ops)
    total = _MoEEngine(hw, counts, ops, dtype_bytes, True, step_s).run()[0]
    alone = _MoEEngine(hw, counts, ops, dtype_bytes, False, step_s).run()[0]
    return MoESim(max(total), max(alone), tuple(total))


def moe_op_time(op: str, method: str, counts: ExpertCounts, K: int, N: int, hw,
                dtype_bytes: float = 4, *, chunks: int = 4, splits: int = 1,
                tail: bool = False, step_s: float = 0.0) -> float:
    """Predicted seconds of one MoE op (the slowest rank)."""
    return simulate_moe([MoEOp(op, method, K, N, chunks, splits, tail)], counts, hw,
                        dtype_bytes, step_s).total_s


def layer_ops(counts: ExpertCounts, dim: int, ffn: int, hw, method: str = "commfuse",
              dtype_bytes: float = 4, backward: bool = True, opts: dict | None = None,
              choose_step_s: float | None = None, top_k: int = 2) -> list[MoEOp]:
    """The ops of one EP MoE layer (module doc), forward then backward, for tokens routed to
    ``top_k`` experts each (the table counts their rows). ``method`` for every MoE op, with
    ``opts``; "auto" picks each op's own (`choose`, with ``choose_step_s``)."""
    hw, opts, d = resolve_hw(hw), dict(opts or {}), dtype_bytes
    w = counts.world
    k_rows = [counts.sent(p) for p in range(w)]
    experts = counts.experts
    recv = [counts.received(q) for q in range(w)]

    def mem(nbytes_per_rank, label):
        bw = hw.mem_bandwidth * hw.mem_efficiency
        return MoEOp("work", per_rank=tuple(b / bw for b in nbytes_per_rank), label=label)

    def op(name, K, N, tail, dual):
        m, o = method, opts
        if method == "auto":
            m, o = choose(name, counts, K, N, hw, d, choose_step_s or 0.0)
        return MoEOp(name, m, K, N, o.get("chunks", 4), o.get("splits", 1), tail)

    # forward: the router (the tokens are T/k per rank), the count exchange, the gather
    tokens = [n / top_k for n in k_rows]
    router = MoEOp("work", per_rank=tuple(
        hw.gemm_time(t, dim, experts, r) + 2 * (hw.host_collective_s + (w - 1) * hw.link_latency)
        for r, t in enumerate(tokens)), label="router")
    # elementwise bytes, kernel by kernel (each reads its inputs, writes its output once):
    # the rows' gather (read, write), SwiGLU (silu 2, mul 3, of F-wide rows), the weighted
    # sum (un-permute 2, scale 2, sum over k 1.5 + 1 of D-wide rows)
    moved = [counts.dispatched(p) for p in range(w)]  # one per (token, rank) with dedup
    ops = [router, mem([n * dim * d * 2 for n in moved], "gather rows"),
           op("moe_dispatch", dim, 2 * ffn, False, ("moe_combine", 2 * ffn, dim)),
           mem([n * ffn * d * 5 for n in recv], "swiglu"),
           op("moe_combine", ffn, dim, False, ("moe_dispatch", dim, ffn)),
           mem([n * dim * d * 6.5 for n in k_rows], "weighted sum")]
    if not backward:
        return ops
    gu, dn = ops[2], ops[4]
    # backward: the weighted sum's (the scaled grad 2, the weights' grad 4, the
    # un-permute's scatter 3), SwiGLU's (two products' grads 6, silu's 3, the gate|up grad
    # assembled 4), the gather's scatter-add (3)
    ops += [mem([n * dim * d * 9 for n in k_rows], "weighted sum backward"),
            MoEOp("moe_dispatch", dn.method, dim, ffn, dn.chunks, dn.splits, True),
            mem([n * ffn * d * 13 for n in recv], "swiglu backward"),
            MoEOp("moe_combine", gu.method, 2 * ffn, dim, gu.chunks, gu.splits, True),
            MoEOp("work", per_rank=tuple(2 * hw.gemm_time(t, experts, dim, r)
                                         for r, t in enumerate(tokens)), label="router bwd"),
            mem([n * dim * d * 3 for n in k_rows], "scatter-add rows")]
    return ops


def moe_layer_time(counts: ExpertCounts, dims: tuple[int, int], hw, method: str = "commfuse",
                   dtype_bytes: float = 4, *, top_k: int = 2, backward: bool = True,
                   step_s: float = 0.0, **opts) -> MoESim:
    """Predicted time of one expert-parallel MoE layer (`layer_ops`): ``counts`` the routed
    rows (`routing_counts` for an expected balanced or skewed table; ``dedup=True`` for the
    one `commfuse.moe.parallel.expert_ffn` moves), ``dims`` = (model width
    D, expert hidden width F), ``top_k`` experts per token, ``method`` for both MoE ops
    ("auto": each op's fastest; ``opts``: ``chunks`` / ``splits``), forward and
    (``backward``) backward. The planner's entry point."""
    dim, ffn = dims
    ops = layer_ops(counts, dim, ffn, hw, method, dtype_bytes, backward, opts, step_s, top_k)
    return simulate_moe(ops, counts, hw, dtype_bytes, step_s)


def fastest(op: str, counts: ExpertCounts, K: int, N: int, hw, dtype_bytes: float,
            step_s: float = 0.0, candidates=CANDIDATES,
            dual: tuple | None = None) -> tuple[str, dict, float]:
    """(method, options, predicted seconds) of the fastest candidate for ``op`` with these
    ``counts``: the op, then (``dual`` = (its backward's op, K, N)) its backward with the
    weight grads as tail, each with ``step_s`` per schedule step. Ties go to the earlier
    candidate. A pure function of its arguments: every rank holding the same table and
    hardware model chooses the same (the choice sets the message sizes)."""
    hw = resolve_hw(hw)
    best = (math.inf, -1)
    for i, (m, o) in enumerate(candidates):
        ops = [MoEOp(op, m, K, N, o.get("chunks", 4), o.get("splits", 1))]
        if dual:
            ops.append(MoEOp(dual[0], m, dual[1], dual[2], o.get("chunks", 4),
                             o.get("splits", 1), True))
        if m == "commfuse" and o.get("splits", 1) > 1 and o["splits"] > max(
                n for row in counts.rows for n in row):
            continue  # more pieces than rows: the same schedule as a smaller m
        t = _MoEEngine(hw, counts, ops, dtype_bytes, True, step_s).run()[0]
        best = min(best, (max(t), i))
    t, i = best
    return candidates[i][0], dict(candidates[i][1]), t


_CHOICES: dict[tuple, tuple[str, dict]] = {}


def choose(op: str, counts: ExpertCounts, K: int, N: int, hw, dtype_bytes: float,
           step_s: float = 0.0) -> tuple[str, dict]:
    """``auto``'s (method, options) for ``op`` with this table: `fastest` (the op and its
    backward) on `representative(counts)`, cached. The counts change every step and timing
    every candidate on them costs tens of ms, so the choice is made once per group size,
    experts per rank and total rows (within a factor of 2^(1/4)), shape, dtype and
    hardware, and share of moved rows (the dedup); a skewed table gets its balanced
    equivalent's choice (which method hides more depends on how the transfers compare to the
    GEMMs, which the totals set)."""
    rep = representative(counts)
    key = (op, rep.tokens, rep.firsts, K, N, dtype_bytes, step_s, repr(resolve_hw(hw)))
    if key not in _CHOICES:
        if len(_CHOICES) > 1024:
            _CHOICES.clear()
        dual = ("moe_combine" if op == "moe_dispatch" else "moe_dispatch", N, K)
        _CHOICES[key] = fastest(op, rep, K, N, hw, dtype_bytes, step_s, dual=dual)[:2]
    method, opts = _CHOICES[key]
    return method, dict(opts)


def representative(counts: ExpertCounts) -> ExpertCounts:
    """The balanced table whose total rows are ``counts``' rounded to a power of 2^(1/4):
    what `choose` decides on (the same for every rank holding ``counts``). A deduplicated
    table keeps its share of moved rows (pairs / rows, rounded to 1/16): every cell's first
    and last rows that share, each token's only expert on a rank where the cell's rows
    cannot hold a first and a last apart."""
    total = sum(map(sum, counts.tokens))
    cells = counts.world * counts.experts
    if total:
        total = 2 ** (round(4 * math.log2(total)) / 4)
    per = round(total / cells)
    rows = ((per,) * counts.experts,) * counts.world
    if not counts.dedup:
        return ExpertCounts(rows)
    moved = sum(map(sum, counts.pairs)) / max(1, sum(map(sum, counts.tokens)))
    f = min(per, round(per * round(16 * moved) / 16))
    single = max(0, 2 * f - per)
    return ExpertCounts(rows, *(((n,) * counts.experts,) * counts.world
                                for n in (f, f, single)))


class _MoEEngine(Engine):
    """The engine on programs compiled here from the MoE schedules (every rank simulated)."""

    def __init__(self, hw: Hardware, counts: ExpertCounts, ops, dtype_bytes: float,
                 comm: bool, step_s: float):
        self.hw, self.w, self.comm, self.timeline = hw, counts.world, comm, False
        self.nr = counts.world
        self.progs, self.coll_time = [[] for _ in range(self.w)], {}
        for job, o in enumerate(ops):
            for r in range(self.w):
                if o.op == "work":
                    s = o.per_rank[r] if o.per_rank else o.seconds
                    self.progs[r].append(("work", s, "compute", f"{job}:{o.label}"))
                else:
                    _compile(self.progs[r], self.coll_time, hw, counts, job, o, r,
                             dtype_bytes, comm, step_s)


def _compile(prog, coll_time, hw: Hardware, c: ExpertCounts, job: int, o: MoEOp, r: int,
             d: float, comm: bool, step_s: float) -> None:
    sched = build(o.op, o.method, c, r, chunks=o.chunks, splits=o.splits, tail=o.tail)
    w, dispatch = c.world, o.op == "moe_dispatch"
    of = [row[r] for row in c.rows]  # my receive-layout slots: rows from / for rank p
    width = o.K if dispatch else o.N  # what a moved row holds
    m, k = o.splits, sched.chunks

    def gemm(p, lo, hi):
        return sum(hw.gemm_time(n, o.K, o.N, r) for n in clip(c.groups(p, r), lo, hi) if n)

    def compute_s(slot):
        if slot == TAIL:
            t = sum(hw.gemm_time(o.K, n, o.N, r) for n in c.expert_rows(r) if n)
            split = sum(n * (o.K + o.N) * d for e, n in enumerate(c.expert_rows(r))
                        if sum(1 for p in range(w) if c.groups(p, r)[e]) > 1)
            return t + hw.copy_time(split, r)
        if o.method == "commfuse":
            p, j = divmod(slot, m)
            off, n = piece(of[p], m, j)
            own = hw.copy_time(n * o.K * d, r) if dispatch and p == r else 0.0
            return gemm(p, off, off + n) + own
        return sum(gemm(p, off, off + n) for p, (off, n) in
                   enumerate(piece(of[p], k, slot) for p in range(w)))

    def nbytes(t):  # the rows the transfer moves: one per (token, rank) with dedup
        p, j = divmod(t.slot, m)
        src, dst = (r, p) if (t.kind == "send") == dispatch else (p, r)  # slot (src -> dst)
        return c.moved_piece(o.op, src, dst, m, j)[1] * width * d if comm else 0.0

    def key(t):
        return (job, r, t.peer, t.tag) if t.kind == "send" else (job, t.peer, r, t.tag)

    host_c, host_p = (hw.host_collective_s, hw.host_p2p_s) if comm and not hw.host_async \
        else (0.0, 0.0)  # host_async: the host runs ahead (launch_bound caps the pieces)
    step = step_s if comm else 0.0
    for st in sched.steps:
        if step:
            prog.append(("work", step, "host", f"{job}:{o.op} step"))
        if isinstance(st, Compute):
            prog.append(("work", compute_s(st.slot), "compute", f"{job}:{o.op} {st.slot}"))
        elif isinstance(st, Post):
            if host_p:
                prog.append(("work", host_p, "host", f"{job}:{o.op} post"))
            prog.append(("post", tuple((key(t), t.kind == "send", nbytes(t),
                                        (r, t.peer) if t.kind == "send" else (t.peer, r))
                                       for t in st.transfers)))
        elif isinstance(st, Wait):
            prog.append(("wait", key(st.transfer)))
        elif isinstance(st, Collective):
            if host_c:
                prog.append(("work", host_c, "host", f"{job}:{o.op} launch {st.slot}"))
            ck = (job, st.slot)
            if ck not in coll_time:
                coll_time[ck] = (_a2a_s(hw, c, o, k, st.slot, d) if comm else 0.0,
                                 f"{job}:{o.op} all_to_all chunk {st.slot}")
            prog.append(("coll", ck))
        elif isinstance(st, WaitCollective):
            prog.append(("wcoll", (job, st.slot)))
        elif isinstance(st, Reduce):
            raise AssertionError("the MoE schedules have no reduction")
    if o.tail and TAIL not in sched.computes():  # none: the weight grads after it all
        prog.append(("work", compute_s(TAIL), "compute", f"{job}:{o.op} tail"))


def _a2a_s(hw: Hardware, c: ExpertCounts, o: MoEOp, k: int, j: int, d: float) -> float:
    """An all-to-all of chunk j of every slot: paced by the rank that sends or receives the
    most off-rank bytes (module doc)."""
    w = c.world
    if w <= 1:
        return 0.0
    def moved(src, dst):  # rows chunk j moves from src to dst
        slot = (src, dst) if o.op == "moe_dispatch" else (dst, src)
        return c.moved_piece(o.op, *slot, k, j)[1]

    width = o.K if o.op == "moe_dispatch" else o.N
    out = [sum(moved(p, q) for q in range(w) if q != p) for p in range(w)]
    inn = [sum(moved(p, q) for p in range(w) if p != q) for q in range(w)]
    busiest = max(max(out), max(inn)) * width * d
    slow = max(hw.link_straggler.values(), default=1.0)
    return ((w - 1) * hw.link_latency + busiest * slow / hw.link_bandwidth) \
        / hw.collective_efficiency

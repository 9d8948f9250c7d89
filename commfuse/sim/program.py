"""Per-rank programs for the engine: each rank's schedules (`commfuse.schedule.build`) turned
into timed instructions, with the costs of `op_costs` on a `Hardware`.

Instructions: ``("work", seconds, kind, label)`` runs on the rank (a GEMM, an add, host
time); ``("post", ((flow key, is_send, bytes, channel), ...))`` registers transfers (the
channel, (sender, receiver) or under symmetry (0, the receiver's offset from the sender),
is the connection a transfer shares with the sender's other ones to that peer); ``("wait", flow
key)``; ``("coll", key)`` / ``("wcoll", key)`` launch / wait for a collective, whose
(duration, label) is in the returned table. A flow key is (job, src, dst, tag); under
symmetry (see `commfuse.sim.engine`) it is (job, 0, 0, tag): rank 0's send and receive of a
tag are one transfer seen from both ends.
"""

from __future__ import annotations

from functools import lru_cache

from commfuse import schedule as S
from commfuse.sim import attention
from commfuse.sim.costs import op_costs
from commfuse.sim.hardware import Hardware


def compile_programs(hw: Hardware, world: int, specs, dtype_bytes: float, comm: bool = True,
                     symmetric: bool = False) -> tuple[list[list], dict]:
    """(programs of the simulated ranks, collective table) for the `OpSpec`s run back to back
    on ``world`` ranks; ``comm=False``: free transfers, collectives and host costs (compute
    alone); ``symmetric``: rank 0's program only (ValueError if ``hw`` has stragglers)."""
    if symmetric and (hw.compute_straggler or hw.link_straggler):
        raise ValueError("symmetric=True needs identical ranks: this hardware has stragglers")
    ranks = 1 if symmetric else world
    progs: list[list] = [[] for _ in range(ranks)]
    coll_time: dict = {}
    for job, spec in enumerate(specs):
        for r in range(ranks):
            if spec.op == "attention":  # local work, no schedule (commfuse.sim.attention)
                progs[r].append(("work", attention.local_attention_s(hw, spec, r), "compute",
                                 f"{job}:attention"))
                continue
            sched = schedule(spec.op, spec.method, world, r, spec.topology, spec.chunks,
                             spec.splits)
            _compile(progs[r], coll_time, hw, world, job, spec, sched, dtype_bytes, comm,
                     symmetric)
    return progs, coll_time


@lru_cache(maxsize=256)
def schedule(op: str, method: str, world: int, rank: int, topology: str = "ring",
             chunks: int = 4, splits: int = 1) -> S.Schedule:
    """`commfuse.schedule.build`, memoized (schedules are immutable; a 1024-rank one is
    thousands of steps, and repeated ops and candidates ask for the same ones)."""
    return S.build(op, method, world, rank, topology=topology, chunks=chunks, splits=splits)


def _compile(prog, coll_time, hw, world, job, spec, sched, d, comm, symmetric) -> None:
    r = sched.rank
    c = op_costs(spec, world, sched.chunks, d)
    gemm = hw.gemm_time(*c.gemm, rank=r)
    add = hw.add_time(c.reduce_bytes, rank=r)
    xb = c.transfer_bytes if comm else 0.0
    host_c, host_p = (hw.host_collective_s, hw.host_p2p_s) if comm and not hw.host_async \
        else (0.0, 0.0)  # host_async: the host runs ahead (launch_bound caps the pieces)

    def key(t: S.Transfer) -> tuple:
        if symmetric:
            return (job, 0, 0, t.tag)
        return (job, r, t.peer, t.tag) if t.kind == "send" else (job, t.peer, r, t.tag)

    def channel(t: S.Transfer) -> tuple:
        src, dst = (r, t.peer) if t.kind == "send" else (t.peer, r)
        return (0, (dst - src) % world) if symmetric else (src, dst)

    # the op's fresh buffers are first written by its GEMMs (and the receives into them)
    slots = sum(isinstance(st, S.Compute) for st in sched.steps)
    touch = hw.first_touch_time(fresh_buffers(spec, world, d, sched), r) / max(slots, 1)
    own, m = 0.0, max(sched.chunks // world, 1)  # P2P: W*m slots, m per rank
    if spec.op == "ag_matmul" and sched.method not in ("none", "sliced"):
        # the P2P binding copies each own sub-slice into the gathered buffer in that slot's
        # compute (ops/ag_matmul.py; its sends read the input; a collective writes them itself)
        own = hw.copy_time(spec.shape[0] / world * spec.shape[1] * d, rank=r) / m
    for st in sched.steps:
        if isinstance(st, S.Compute):
            attn = attention.slot_attention_s(hw, spec, world, st.slot, sched.chunks if
                                              sched.method in ("none", "sliced") else 0, r) \
                if spec.attention else 0.0
            mine = own if st.slot // m == r else 0.0
            prog.append(("work", gemm + attn + touch + mine, "compute",
                         f"{job}:{spec.op} slot {st.slot}"))
        elif isinstance(st, S.Reduce):
            prog.append(("work", add * (len(st.peers) - 1), "reduce",
                         f"{job}:{spec.op} add slot {st.slot}"))
        elif isinstance(st, S.Post):
            if host_p:
                prog.append(("work", host_p, "host", f"{job}:{spec.op} post"))
            prog.append(("post", tuple((key(t), t.kind == "send", xb, channel(t))
                                       for t in st.transfers)))
        elif isinstance(st, S.Wait):
            prog.append(("wait", key(st.transfer)))
        elif isinstance(st, S.Collective):
            if host_c:
                prog.append(("work", host_c, "host", f"{job}:{spec.op} launch {st.slot}"))
            k = (job, st.slot)
            if k not in coll_time:
                coll_time[k] = (hw.collective_time(c.collective, c.collective_bytes, world)
                                if comm else 0.0,
                                f"{job}:{spec.op} {c.collective} chunk {st.slot}")
            prog.append(("coll", k))
        else:
            prog.append(("wcoll", (job, st.slot)))


def fresh_buffers(spec, world: int, d: float, sched: S.Schedule) -> tuple[float, ...]:
    """Bytes of each buffer one rank's op allocates under ``sched`` (conventions of
    `op_costs`), as its binding does (`commfuse.ops.ag_matmul`, `commfuse.ops.matmul_rs`):

    - AG -> GEMM: the gathered [M, K] and the product [M, N]; ``sliced`` also gathers each
      chunk into its own buffer and computes its product into another.
    - GEMM -> RS: a new partial per compute step (a slot, or a chunk of every slice), a new
      buffer per P2P receive and per sum of a peer's slot, and the result [M/W, N].
    - the all-to-all ops: what they receive and what they compute."""
    (M, K, N), w = spec.shape, world
    steps = sched.steps
    computes = max(sum(isinstance(st, S.Compute) for st in steps), 1)
    if spec.op == "ag_matmul":
        chunked = (M / computes * K, M / computes * N) * computes \
            if sched.method == "sliced" and computes > 1 else ()
        return tuple(b * d for b in (M * K, M * N, *chunked))
    if spec.op == "matmul_rs":
        m = max(sched.chunks // w, 1)  # P2P: m slots per rank
        recvs = sum(t.kind == "recv" for st in steps if isinstance(st, S.Post)
                    for t in st.transfers)
        sums = sum(isinstance(st, S.Reduce) and st.slot // m != sched.rank for st in steps)
        return (M / computes * N * d,) * (computes + recvs + sums) + (M / w * N * d,)
    rows = {"matmul_a2a": (M / w * N, M * N / w), "a2a_matmul": (M / w * K, M / w * N)}
    return tuple(b * d for b in rows.get(spec.op, ()))

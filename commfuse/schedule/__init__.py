"""Schedules as data: the ordered steps each rank runs for one fused op.

A schedule is a pure function of (op, method, world size, rank, options). The executor
(`commfuse.runtime.executor`) runs it on a process group and the simulator times the very same
objects, so what is simulated is what runs. Nothing here touches tensors or processes.

Vocabulary (``slot`` is a slice index along the gathered/scattered dim for P2P methods, a
chunk index for the collective-based ``sliced``/``none``):

- ``Post(transfers)``  start these sends/receives together (one batch: NCCL needs a send and
  a receive between the same pair grouped, gloo does not care);
- ``Wait(transfer)``   block until that transfer is done (each transfer waited exactly once);
- ``Compute(slot)``    the op's partial GEMM for that slot;
- ``Reduce(slot, peers)`` sum the partials for ``slot`` in the order given: the received one
  from each peer, this rank's own local partial where ``peers`` names this rank;
- ``Collective(slot)`` / ``WaitCollective(slot)`` start / finish the op's collective on a chunk.

The four ops and their sides:

=============  ===========  =======================================================
op             side         P2P pattern under decompose / commfuse
=============  ===========  =======================================================
ag_matmul      gather       ring: forward slices to r+1; direct: own slice to r+k
a2a_matmul     gather       pairwise: block for r+k to r+k, from r-k (always direct)
matmul_rs      reduce       ring: running sum to r+1; direct: partial to its owner
matmul_a2a     reduce       pairwise: block for r+k to r+k, from r-k (always direct)
=============  ===========  =======================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

OPS = ("ag_matmul", "matmul_rs", "matmul_a2a", "a2a_matmul")
METHODS = ("none", "sliced", "decompose", "commfuse")
TOPOLOGIES = ("ring", "direct")
COLLECTIVE_POLICIES = ("auto", "backend", "p2p")  # none/sliced: whose collective runs
# The named variants of the methods, (method, options) by label: every list of methods in the
# package (the benchmarks, the demo, auto's candidates, the simulator's calibration) picks
# from this one table. "auto" is not a schedule: it picks one of the others per shape.
VARIANTS: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "none-torch": ("none", {"collective": "backend"}),  # torch's own collective (slow on gloo)
    "sliced": ("sliced", {"chunks": 4}),
    "decompose": ("decompose", {"topology": "ring"}),
    "commfuse": ("commfuse", {"topology": "ring"}),  # splits: chosen per shape (ops.auto)
    "commfuse-m1": ("commfuse", {"topology": "ring", "splits": 1}),  # the paper's schedule
    "commfuse-m2": ("commfuse", {"topology": "ring", "splits": 2}),  # 2 sub-slices per rank
    "commfuse-m4": ("commfuse", {"topology": "ring", "splits": 4}),  # 4 sub-slices per rank
    "commfuse-m8": ("commfuse", {"topology": "ring", "splits": 8}),  # 8 sub-slices per rank
    "commfuse-direct": ("commfuse", {"topology": "direct"}),
    "auto": ("auto", {}),  # commfuse.ops.auto's choice on the simulator's cost model
}
GATHER_SIDE = ("ag_matmul", "a2a_matmul")  # the collective feeds the GEMM
REDUCE_SIDE = ("matmul_rs", "matmul_a2a")  # the GEMM feeds the collective
# ops whose sends carry only their input or what they received, never what a Compute wrote
# (a send's slot may even number other data than a Compute's: a2a_matmul, direct ag_matmul)
SENDS_INPUT = (*GATHER_SIDE, "moe_dispatch")


@dataclass(frozen=True)
class Transfer:
    """One side of a point-to-point message.

    ``slot`` is what the buffer holds from this rank's point of view (a send's slot and its
    matching receive's slot may differ, as in an all-to-all); ``tag`` is the step it belongs
    to, the same on both sides, which is what matches a send with its receive.
    """

    kind: Literal["send", "recv"]
    slot: int
    peer: int  # destination of a send, source of a receive
    tag: int


@dataclass(frozen=True)
class Post:
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class Wait:
    transfer: Transfer


@dataclass(frozen=True)
class Compute:
    slot: int


@dataclass(frozen=True)
class Reduce:
    slot: int
    peers: tuple[int, ...]


@dataclass(frozen=True)
class Collective:
    slot: int


@dataclass(frozen=True)
class WaitCollective:
    slot: int


Step = Union[Post, Wait, Compute, Reduce, Collective, WaitCollective]


@dataclass(frozen=True)
class Schedule:
    """The steps one rank runs for one op invocation."""

    op: str
    method: str
    world_size: int
    rank: int
    topology: str
    chunks: int  # number of slots the op's buffers are cut into (W*m for P2P, k for sliced)
    steps: tuple[Step, ...]

    def computes(self) -> list[int]:
        return [s.slot for s in self.steps if isinstance(s, Compute)]

    def transfers(self) -> list[Transfer]:
        return [t for s in self.steps if isinstance(s, Post) for t in s.transfers]


def build(op: str, method: str, world_size: int, rank: int, *,
          topology: str = "ring", chunks: int = 4, splits: int = 1) -> Schedule:
    """The schedule of ``op`` under ``method`` for ``rank`` of ``world_size`` ranks.

    ``chunks``: sliced's chunk count. ``splits`` (m): decompose/commfuse cut each rank's slice
    into m sub-slices (slot p*m + j is sub-slice j of rank p's slice), so the pipeline moves
    and computes W*m pieces: finer steps hide more when a transfer outlasts a slice's GEMM.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank {rank} of world size {world_size}")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if op in ("matmul_a2a", "a2a_matmul"):
        topology = "direct"  # an all-to-all block has one destination: nothing to forward
    if method in ("none", "sliced"):
        k = 1 if method == "none" else chunks
        steps = _collective_gather(k) if op in GATHER_SIDE else _collective_reduce(k)
        return Schedule(op, method, world_size, rank, topology, k, tuple(steps))
    sync = method == "decompose"
    fn = _p2p_gather if op in GATHER_SIDE else _p2p_reduce
    steps = fn(op, world_size, rank, topology, sync, splits)
    return Schedule(op, method, world_size, rank, topology, world_size * splits, tuple(steps))


def _collective_gather(k: int) -> list[Step]:
    """Gather chunk j+1 while computing chunk j; the first gather is exposed (the head)."""
    steps: list[Step] = [Collective(0)]
    for j in range(k):
        steps.append(WaitCollective(j))
        if j + 1 < k:
            steps.append(Collective(j + 1))  # hides behind Compute(j)
        steps.append(Compute(j))
    return steps


def _collective_reduce(k: int) -> list[Step]:
    """Reduce chunk j while computing chunk j+1; the last reduction is exposed (the tail)."""
    steps: list[Step] = []
    for j in range(k):
        steps += [Compute(j), Collective(j)]
    return steps + [WaitCollective(j) for j in range(k)]


def _p2p_gather(op: str, w: int, r: int, topology: str, sync: bool, m: int) -> list[Step]:
    """Gather side: compute slices r, r-1, ..., r+1 (each in m sub-slices j = 0..m-1).

    commfuse: every transfer is posted as soon as its data is here (own data at the start, a
    forwarded sub-slice on arrival), in the order it will be consumed; a receive is waited
    only just before the compute that needs it; sends are waited at the very end.
    decompose: the same order, but each step posts its transfer and waits for it (send and
    receive) before the next compute.
    """
    order = [(r - i) % w for i in range(w)]
    ring = op == "ag_matmul" and topology == "ring"

    def transfer(i: int, j: int) -> tuple[Transfer, Transfer]:
        """The transfers that bring sub-slice j of slice order[i] here."""
        tag = i * m + j
        if op == "a2a_matmul":  # my block for rank r+i, and rank r-i's block for me
            send = Transfer("send", _slot((r + i) % w, j, m), (r + i) % w, tag)
        elif ring:  # forward what arrived last step to my successor
            send = Transfer("send", _slot(order[i - 1], j, m), (r + 1) % w, tag)
        else:  # direct: my own slice straight to rank r+i
            send = Transfer("send", _slot(r, j, m), (r + i) % w, tag)
        src = (r - 1) % w if ring else (r - i) % w
        return send, Transfer("recv", _slot(order[i], j, m), src, tag)

    steps: list[Step] = []
    sends: list[Transfer] = []

    def post(i: int, j: int) -> None:
        send, recv = transfer(i, j)
        steps.append(Post((send, recv)))
        sends.append(send)

    if not sync:  # all that can start now: hides behind the own slice's compute
        for i in range(1, 2 if ring else w):
            for j in range(m if w > 1 else 0):
                post(i, j)
    for i in range(w):
        for j in range(m):
            if i > 0 and not sync:
                steps.append(Wait(transfer(i, j)[1]))  # the sub-slice this compute needs
                if ring and i + 1 < w:
                    post(i + 1, j)  # forward it at once
            if sync and i + 1 < w:
                post(i + 1, j)
            steps.append(Compute(_slot(order[i], j, m)))
            if sync and i + 1 < w:
                steps += [Wait(sends[-1]), Wait(transfer(i + 1, j)[1])]
    if not sync:
        steps += [Wait(t) for t in sends]
    return steps


def _p2p_reduce(op: str, w: int, r: int, topology: str, sync: bool, m: int) -> list[Step]:
    """Reduce side: compute the partials others own first, this rank's own slice last.

    ring (matmul_rs): at step i compute slice r-i-1 (sub-slice by sub-slice), add the running
    sum from r-1, send it to r+1; the own slice's GEMMs hide the last transfers and one add
    follows each. direct / matmul_a2a: at step i compute the block for rank r+i+1 and send it
    straight there; rank r-i-1's block for me arrives meanwhile; matmul_rs sums in rank order.
    decompose waits for each step's transfers before the next compute.
    """
    ring = op == "matmul_rs" and topology == "ring"
    order = [(r - i - 1) % w for i in range(w)] if ring else [(r + i + 1) % w for i in range(w)]

    def incoming(i: int, j: int) -> Transfer:
        """What arrives during step i (consumed at step i+1 on the ring, at the end otherwise)."""
        if ring:
            return Transfer("recv", _slot(order[i + 1], j, m), (r - 1) % w, i * m + j)
        src = (r - i - 1) % w
        return Transfer("recv", _slot(r if op == "matmul_rs" else src, j, m), src, i * m + j)

    steps: list[Step] = []
    pending: list[Transfer] = []  # transfers to wait for at the end
    for i in range(w):
        for j in range(m):
            slot = _slot(order[i], j, m)
            steps.append(Compute(slot))
            if ring and i > 0:
                if not sync:
                    steps.append(Wait(incoming(i - 1, j)))  # the running sum for this slot
                steps.append(Reduce(slot, ((r - 1) % w, r)))
            if i + 1 < w:
                send = Transfer("send", slot, (r + 1) % w if ring else order[i], i * m + j)
                recv = incoming(i, j)
                steps.append(Post((send, recv)))  # hides behind the next compute
                if sync:
                    steps += [Wait(send), Wait(recv)]
                else:
                    pending += [send] if ring else [send, recv]
    if not sync:
        steps += [Wait(t) for t in sorted(pending, key=lambda t: t.kind == "send")]
    if op == "matmul_rs" and not ring and w > 1:
        steps += [Reduce(_slot(r, j, m), tuple(range(w))) for j in range(m)]
    return steps


def _slot(p: int, j: int, m: int) -> int:
    """Sub-slice j of rank p's slice, when each slice is cut into m."""
    return p * m + j


def even_sizes(total: int, world: int) -> tuple[int, ...]:
    """Rows per rank of ``total`` rows over ``world`` ranks, as even as possible, the first
    ranks one longer (10 over 4: 3, 3, 2, 2): the split every op assumes by default."""
    base, extra = total // world, total % world  # not divmod: Dynamo's symbolic sizes lack it
    return tuple(base + 1 if i < extra else base for i in range(world))


def balanced_split(total: int, world: int) -> tuple[tuple[int, ...], list[int]]:
    """(rows per rank, the sequence positions of the slots in rank order) of query-split
    attention's balanced order: ``total`` rows cut into 2W chunks (`even_sizes`), rank p's
    slot is chunk p then chunk 2W-1-p (16 rows over 2 ranks: positions 0-3, 12-15 | 4-7,
    8-11), so under a causal mask every slot costs the same."""
    chunks = even_sizes(total, 2 * world)
    starts = [sum(chunks[:i]) for i in range(2 * world)]
    pos: list[int] = []
    sizes = []
    for p in range(world):
        for c in (p, 2 * world - 1 - p):
            pos += range(starts[c], starts[c] + chunks[c])
        sizes.append(chunks[p] + chunks[2 * world - 1 - p])
    return tuple(sizes), pos

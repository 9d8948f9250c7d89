"""Schedules as data: the ordered steps each rank runs for one fused op.

A schedule is a pure function of (op, method, world size, rank, options). The executor
(`commfuse.executor`) runs it on a process group and the simulator times the very same
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
GATHER_SIDE = ("ag_matmul", "a2a_matmul")  # the collective feeds the GEMM
REDUCE_SIDE = ("matmul_rs", "matmul_a2a")  # the GEMM feeds the collective


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
    chunks: int  # number of slots the op's buffers are cut into (W for P2P, k for sliced)
    steps: tuple[Step, ...]

    def computes(self) -> list[int]:
        return [s.slot for s in self.steps if isinstance(s, Compute)]

    def transfers(self) -> list[Transfer]:
        return [t for s in self.steps if isinstance(s, Post) for t in s.transfers]


def build(op: str, method: str, world_size: int, rank: int, *,
          topology: str = "ring", chunks: int = 4) -> Schedule:
    """The schedule of ``op`` under ``method`` for ``rank`` of ``world_size`` ranks."""
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
    if op in ("matmul_a2a", "a2a_matmul"):
        topology = "direct"  # an all-to-all block has one destination: nothing to forward
    if method in ("none", "sliced"):
        k = 1 if method == "none" else chunks
        steps = _collective_gather(k) if op in GATHER_SIDE else _collective_reduce(k)
        return Schedule(op, method, world_size, rank, topology, k, tuple(steps))
    sync = method == "decompose"
    if op in GATHER_SIDE:
        steps = _p2p_gather(op, world_size, rank, topology, sync)
    else:
        steps = _p2p_reduce(op, world_size, rank, topology, sync)
    return Schedule(op, method, world_size, rank, topology, world_size, tuple(steps))


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


def _p2p_gather(op: str, w: int, r: int, topology: str, sync: bool) -> list[Step]:
    """Gather side: compute slots r, r-1, ..., r+1; slot r-i arrives during step i-1.

    commfuse: post transfer i+1 as soon as its data is there, compute, and wait only for the
    slot the next compute needs; sends are waited at the very end.
    decompose: same order, but each step waits for all its transfers before the next.
    """
    order = [(r - i) % w for i in range(w)]

    def transfer(i: int) -> tuple[Transfer, Transfer]:
        """The transfers that bring slot order[i] here, posted during step i-1."""
        if op == "a2a_matmul":  # my block for rank r+i, and rank r-i's block for me
            send = Transfer("send", (r + i) % w, (r + i) % w, i)
        elif topology == "ring":  # forward what I computed on last to my successor
            send = Transfer("send", order[i - 1], (r + 1) % w, i)
        else:  # direct: my own slice straight to rank r+i
            send = Transfer("send", r, (r + i) % w, i)
        src = (r - 1) % w if (op == "ag_matmul" and topology == "ring") else (r - i) % w
        return send, Transfer("recv", order[i], src, i)

    steps: list[Step] = []
    sends: list[Transfer] = []
    for i in range(w):
        if i > 0 and not sync:
            steps.append(Wait(transfer(i)[1]))  # the slot this step computes on
        if i + 1 < w:
            send, recv = transfer(i + 1)
            steps.append(Post((send, recv)))  # hides behind Compute(order[i])
            sends.append(send)
        steps.append(Compute(order[i]))
        if sync and i + 1 < w:
            steps += [Wait(send), Wait(recv)]
    if not sync:
        steps += [Wait(s) for s in sends]
    return steps


def _p2p_reduce(op: str, w: int, r: int, topology: str, sync: bool) -> list[Step]:
    """Reduce side: compute the partials others own first, this rank's own slot last.

    ring (matmul_rs): at step i compute slot r-i-1, add the running sum from r-1, send to r+1;
    the own slot's GEMM hides the last transfer and one add follows it.
    direct / matmul_a2a: at step i compute the block for rank r+i+1 and send it straight there;
    rank r-i-1's block for me arrives meanwhile; matmul_rs then sums in rank order.
    """
    ring = op == "matmul_rs" and topology == "ring"
    order = [(r - i - 1) % w for i in range(w)] if ring else [(r + i + 1) % w for i in range(w)]

    def incoming(i: int) -> Transfer:
        """What arrives during step i (consumed at step i+1 on the ring, at the end otherwise)."""
        if ring:
            return Transfer("recv", order[i + 1], (r - 1) % w, i)
        src = (r - i - 1) % w
        return Transfer("recv", r if op == "matmul_rs" else src, src, i)

    steps: list[Step] = []
    pending: list[Transfer] = []  # transfers to wait for at the end
    for i in range(w):
        steps.append(Compute(order[i]))
        if ring and i > 0:
            if not sync:
                steps.append(Wait(incoming(i - 1)))  # the running sum for this slot
            steps.append(Reduce(order[i], ((r - 1) % w, r)))
        if i + 1 < w:
            send = Transfer("send", order[i], (r + 1) % w if ring else order[i], i)
            recv = incoming(i)
            steps.append(Post((send, recv)))  # hides behind Compute(order[i+1])
            if sync:
                steps += [Wait(send), Wait(recv)]
            else:
                pending += [send] if ring else [send, recv]
    if not sync:
        steps += [Wait(t) for t in sorted(pending, key=lambda t: t.kind == "send")]
    if op == "matmul_rs" and not ring and w > 1:
        steps.append(Reduce(r, tuple(range(w))))
    return steps

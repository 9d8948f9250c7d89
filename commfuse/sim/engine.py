"""Discrete-event simulator: times the schedules of `commfuse.schedule.build` on a `Hardware`.

Every rank runs its program (`commfuse.sim.program`: its schedules' steps, ops stacked back
to back) in order. Steps mean:
``Compute(slot)`` the slot's partial GEMM (`op_costs`); ``Reduce(slot, peers)`` one add of the
slot's output per extra term; ``Post`` registers sends/receives, a transfer (matched by
(src, dst, tag)) starts when both sides are posted, so a send never starts before the steps
before it on its rank (its data) are done; ``Wait`` blocks the rank until that transfer is
done; ``Collective(slot)`` starts once every rank has posted it and runs for the ring model's
time (`Hardware.collective_time`), one collective at a time in launch order (one communicator
stream, as NCCL/HCCL/gloo run them); ``WaitCollective`` blocks until it is done.

Transfers are a fluid model: a transfer drains its bytes at a fair share of its source's
egress and its destination's ingress (each split evenly among the transfers using it,
``duplex_efficiency`` applied when a rank sends and receives at once), rates recomputed at
every event, then pays ``link_latency``. With ``Hardware.fifo_per_peer`` (gloo: one sender
thread and connection per peer) a rank's transfers to one peer drain one at a time, in the
order they become ready, the next starting when the one before has drained. With ``Hardware.serial_p2p`` (NCCL: every P2P batch of a
group runs on the group's one stream) a rank's ``Post`` batches run one after another: a
batch's transfers are posted on that rank only once all of its earlier batches are done. Compute runs at 1/(1+interference) speed while a
transfer or collective is in flight on its rank. Collectives do not share links with P2P
transfers (no schedule mixes them). Host costs (``Hardware.host_collective_s`` before each
``Collective``, ``host_p2p_s`` before each ``Post``) are work on the rank: nothing else runs
on it meanwhile. Events sit in a heap; stale ones carry an old version.

``symmetric=True`` runs rank 0 alone. Without stragglers every schedule is invariant under
the rotation r -> r+1 (peers shift with the rank), so every rank's timeline is rank 0's: the
transfer rank 0 sends with tag t and the one it receives with tag t are the same transfer
seen from its two ends (one is the other, shifted), a collective starts when rank 0 launches
it, and the fair shares of a rank's egress and ingress are rank 0's. One rank instead of W:
what makes 1024-rank groups cheap to time; tests check it against the full run.
"""

from __future__ import annotations

import heapq
from collections import deque

from commfuse.sim.hardware import Hardware
from commfuse.sim.program import compile_programs
from commfuse.trace import Span


class _Flow:
    __slots__ = ("key", "src", "dst", "left", "rate", "t", "ver", "start", "posted", "done",
                 "waiters", "label", "channel")

    def __init__(self, key, src, dst, nbytes, label, channel):
        self.key, self.src, self.dst, self.left, self.label = key, src, dst, nbytes, label
        self.channel = channel
        self.rate = self.t = self.start = 0.0
        self.ver = self.posted = 0
        self.done, self.waiters = False, []


class _Task:
    __slots__ = ("left", "rate", "t", "ver", "start", "kind", "label")


class Engine:
    """Runs per-rank programs of `OpSpec`s; `run` returns (finish time per rank, spans): a
    `commfuse.trace.Span` per compute, reduce, host, send, recv, wait and collective."""

    def __init__(self, hw: Hardware, world: int, specs, dtype_bytes: float,
                 comm: bool = True, timeline: bool = True, symmetric: bool = False):
        self.hw, self.w, self.comm, self.timeline = hw, world, comm, timeline
        self.nr = 1 if symmetric else world  # ranks actually simulated
        self.progs, self.coll_time = compile_programs(hw, world, specs, dtype_bytes, comm,
                                                      symmetric)

    def work_s(self, rank: int = 0) -> float:
        """``rank``'s GEMMs and adds end to end (no host time): its compute alone."""
        return sum(i[1] for i in self.progs[rank] if i[0] == "work" and i[2] != "host")

    # -- event loop ---------------------------------------------------------------------------
    def run(self):
        w = self.nr
        self.now, self.heap, self.seq, self.vc = 0.0, [], 0, 0
        self.pc, self.finish, self.spans = [0] * w, [None] * w, []
        self.task: list = [None] * w
        self.blocked: list = [None] * w  # (start time, label) while waiting
        self.flows: dict = {}
        self.out: list[dict] = [{} for _ in range(w)]  # draining flows by source
        self.inn: list[dict] = [{} for _ in range(w)]  # draining flows by destination
        self.ncoll = [0] * w
        self.colls: dict = {}  # key -> [arrived, done, waiters, start]
        self.coll_queue: list = []  # ready collectives; the first one is running
        self.dirty: set = set()  # ranks whose flows' rates are stale (see _reflow)
        # fifo_per_peer: channel -> its ready flows, the first one draining
        self.lanes: dict = {} if self.hw.fifo_per_peer else None
        # serial_p2p: each rank's posted batches, in post order; the first one is running
        self.queue = [deque() for _ in range(w)] if self.hw.serial_p2p else None
        for r in range(w):
            self._advance(r)
        while True:
            if self.dirty and (not self.heap or self.heap[0][0] > self.now):
                self._flush()  # nothing else is due at this instant
            if not self.heap:
                break
            t, _, what, obj, ver = heapq.heappop(self.heap)
            self.now = t
            if what == 0:  # a rank's compute task ends
                task = self.task[obj]
                if task is not None and task.ver == ver:
                    self.task[obj] = None
                    self._span(obj, task.kind, task.label, task.start, t)
                    self.pc[obj] += 1
                    self._advance(obj)
            elif what == 1:  # a flow has drained its bytes
                if obj.ver == ver:
                    self._drained(obj)
            elif what == 2:  # a flow's latency has passed: done
                self._flow_done(obj)
            else:  # a collective is done
                self._coll_done(obj)
        if any(f is None for f in self.finish):
            stuck = [r for r in range(w) if self.finish[r] is None]
            raise RuntimeError(f"simulation deadlocked: ranks {stuck[:8]} stuck at steps "
                               f"{[self.progs[r][self.pc[r]] for r in stuck[:3]]}")
        return self.finish, self.spans

    def _push(self, t, what, obj, ver=0):
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, what, obj, ver))

    def _span(self, r, kind, label, t0, t1):
        if self.timeline:
            self.spans.append(Span(r, kind, label, t0, t1))

    def _advance(self, r: int) -> None:
        """Run rank r's steps until it computes, blocks or ends."""
        prog = self.progs[r]
        while self.pc[r] < len(prog):
            ins = prog[self.pc[r]]
            kind = ins[0]
            if kind == "work":
                self._start_task(r, ins[1], ins[2], ins[3])
                return
            if kind == "post":
                batch = []
                for key, is_send, nbytes, channel in ins[1]:
                    f = self.flows.get(key)
                    if f is None:
                        f = self.flows[key] = _Flow(key, key[1], key[2], nbytes,
                                                    f"{key[0]}:tag {key[3]} {key[1]}->{key[2]}",
                                                    channel)
                    batch.append(f)
                if self.queue is None:
                    self._activate(batch)
                else:  # serial_p2p: behind the rank's earlier batches
                    self.queue[r].append(batch)
                    if len(self.queue[r]) == 1:
                        self._activate(batch)
            elif kind == "wait":
                f = self.flows[ins[1]]
                if not f.done:
                    f.waiters.append(r)
                    self.blocked[r] = (self.now, f"wait {f.label}")
                    return
            elif kind == "coll":
                c = self.colls.setdefault(ins[1], [0, False, [], 0.0])
                c[0] += 1
                if c[0] == self.nr:  # collectives run one at a time, in launch order
                    self.coll_queue.append(ins[1])
                    if len(self.coll_queue) == 1:
                        self._start_coll(ins[1], c)
            else:  # wcoll
                c = self.colls[ins[1]]
                if not c[1]:
                    c[2].append(r)
                    self.blocked[r] = (self.now, f"wait {self.coll_time[ins[1]][1]}")
                    return
            self.pc[r] += 1
        self.finish[r] = self.now

    def _activate(self, batch) -> None:
        """One side of each transfer of ``batch`` is posted: those with both start."""
        for f in batch:
            f.posted += 1
            if f.posted == 2:
                self._start_flow(f)

    def _next_batch(self, r: int) -> None:
        """serial_p2p: rank r's head batch is done once all its transfers are: start the next."""
        q = self.queue[r]
        while q and all(f.done for f in q[0]):
            q.popleft()
            if q:
                self._activate(q[0])

    def _wake(self, r: int) -> None:
        t0, label = self.blocked[r]
        self.blocked[r] = None
        if self.now > t0:
            self._span(r, "wait", label, t0, self.now)
        self.pc[r] += 1
        self._advance(r)

    def _compute_rate(self, r: int) -> float:
        busy = self.out[r] or self.inn[r] or self.ncoll[r]
        return 1.0 / (1.0 + self.hw.interference) if busy and self.comm else 1.0

    def _start_task(self, r, seconds, kind, label):
        task = _Task()
        self.vc += 1  # versions are global: a stale event never matches a later task
        task.left, task.t, task.ver, task.start = seconds, self.now, self.vc, self.now
        task.kind, task.label, task.rate = kind, label, self._compute_rate(r)
        self.task[r] = task
        self._push(self.now + seconds / task.rate, 0, r, task.ver)

    def _retime_task(self, r: int) -> None:
        task = self.task[r]
        if task is None:
            return
        rate = self._compute_rate(r)
        if rate == task.rate:
            return
        task.left = max(task.left - (self.now - task.t) * task.rate, 0.0)
        self.vc += 1
        task.t, task.rate, task.ver = self.now, rate, self.vc
        self._push(self.now + task.left / rate, 0, r, task.ver)

    def _flow_rate(self, f: _Flow) -> float:
        hw, out, inn = self.hw, self.out, self.inn
        eg = hw.bandwidth(f.src) * (hw.duplex_efficiency if inn[f.src] else 1.0)
        ig = hw.bandwidth(f.dst) * (hw.duplex_efficiency if out[f.dst] else 1.0)
        return min(eg / len(out[f.src]), ig / len(inn[f.dst]))

    def _reflow(self, a: int, b: int) -> None:
        """Flows touching ranks a or b changed: their rates and compute are recomputed once
        no other event is due at this instant (`_flush`), so W flows that start or drain
        together cost O(W), not O(W^2)."""
        self.dirty.add(a)
        self.dirty.add(b)

    def _flush(self) -> None:
        """Recompute the rates of every draining flow touching a dirty rank, and its compute."""
        seen: dict = {}
        for r in self.dirty:
            seen.update(self.out[r])
            seen.update(self.inn[r])
        now = self.now
        for f in seen:
            rate = self._flow_rate(f)
            if rate != f.rate:
                f.left = max(f.left - (now - f.t) * f.rate, 0.0)
                f.t, f.rate, f.ver = now, rate, f.ver + 1
                self._push(now + f.left / rate, 1, f, f.ver)
        dirty, self.dirty = self.dirty, set()
        for r in dirty:
            self._retime_task(r)

    def _start_flow(self, f: _Flow) -> None:
        f.start = f.t = self.now
        if self.lanes is not None and f.left > 0:  # fifo_per_peer: behind the channel's others
            lane = self.lanes.setdefault(f.channel, deque())
            lane.append(f)
            if len(lane) > 1:
                return
        self._drain(f)

    def _drain(self, f: _Flow) -> None:
        """``f`` starts moving its bytes (at once, or once its channel is free)."""
        f.t = self.now
        if f.left <= 0:
            self._push(self.now + (self.hw.link_latency if self.comm else 0.0), 2, f)
            return
        self.out[f.src][f] = None
        self.inn[f.dst][f] = None
        f.rate = 0.0
        self._reflow(f.src, f.dst)

    def _drained(self, f: _Flow) -> None:
        del self.out[f.src][f], self.inn[f.dst][f]
        f.left, f.ver = 0.0, f.ver + 1
        self._reflow(f.src, f.dst)
        if self.lanes is not None:  # the channel's next flow goes on the wire
            lane = self.lanes[f.channel]
            lane.popleft()
            if lane:
                self._drain(lane[0])
        self._push(self.now + self.hw.link_latency, 2, f)

    def _flow_done(self, f: _Flow) -> None:
        f.done = True
        if self.comm:
            self._span(f.src, "send", f.label, f.start, self.now)
            self._span(f.dst, "recv", f.label, f.start, self.now)
        if self.queue is not None:
            for r in {f.src, f.dst}:
                self._next_batch(r)
        for r in f.waiters:
            self._wake(r)

    def _start_coll(self, key, c) -> None:
        c[3] = self.now
        duration = self.coll_time[key][0]
        if duration > 0:
            for r in range(self.nr):
                self.ncoll[r] += 1
                self._retime_task(r)
        self._push(self.now + duration, 3, key)

    def _coll_done(self, key) -> None:
        c = self.colls[key]
        c[1] = True
        duration, label = self.coll_time[key]
        if duration > 0:
            for r in range(self.nr):
                self.ncoll[r] -= 1
                self._retime_task(r)
                self._span(r, "collective", label, c[3], self.now)
        self.coll_queue.pop(0)
        if self.coll_queue:
            nxt = self.coll_queue[0]
            self._start_coll(nxt, self.colls[nxt])
        for r in c[2]:
            self._wake(r)

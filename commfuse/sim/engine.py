"""Discrete-event simulator: times the schedules of `commfuse.schedule.build` on a `Hardware`.

Every rank runs its schedule's steps in order (ops stacked back to back). Steps mean:
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
every event, then pays ``link_latency``. Compute runs at 1/(1+interference) speed while a
transfer or collective is in flight on its rank. Collectives do not share links with P2P
transfers (no schedule mixes them). Events sit in a heap; stale ones carry an old version.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from commfuse import schedule as S
from commfuse.sim.costs import OpSpec, op_costs
from commfuse.sim.hardware import Hardware


@dataclass(frozen=True)
class Span:
    """One interval of a rank's timeline. kind: compute, reduce, send, recv, wait, collective."""

    rank: int
    kind: str
    label: str
    start: float
    end: float


class _Flow:
    __slots__ = ("key", "src", "dst", "left", "rate", "t", "ver", "start", "posted", "done",
                 "waiters", "label")

    def __init__(self, key, src, dst, nbytes, label):
        self.key, self.src, self.dst, self.left, self.label = key, src, dst, nbytes, label
        self.rate = self.t = self.start = 0.0
        self.ver = self.posted = 0
        self.done, self.waiters = False, []


class _Task:
    __slots__ = ("left", "rate", "t", "ver", "start", "kind", "label")


class Engine:
    """Runs per-rank programs of `OpSpec`s; `run` returns (finish time per rank, spans)."""

    def __init__(self, hw: Hardware, world: int, specs, dtype_bytes: float,
                 comm: bool = True, timeline: bool = True):
        self.hw, self.w, self.comm, self.timeline = hw, world, comm, timeline
        self.progs: list[list] = [[] for _ in range(world)]
        self.coll_time: dict = {}
        cache: dict = {}
        for job, spec in enumerate(specs):
            for r in range(world):
                k = (spec, r)
                if k not in cache:
                    cache[k] = S.build(spec.op, spec.method, world, r, topology=spec.topology,
                                       chunks=spec.chunks, splits=spec.splits)
                self._compile(job, spec, cache[k], dtype_bytes)

    def _compile(self, job, spec, sched, d) -> None:
        r, hw, prog = sched.rank, self.hw, self.progs[sched.rank]
        c = op_costs(spec, self.w, sched.chunks, d)
        gemm = hw.gemm_time(*c.gemm, rank=r)
        add = hw.add_time(c.reduce_bytes, rank=r)
        xb = c.transfer_bytes if self.comm else 0.0
        for st in sched.steps:
            if isinstance(st, S.Compute):
                prog.append(("work", gemm, "compute", f"{job}:{spec.op} slot {st.slot}"))
            elif isinstance(st, S.Reduce):
                prog.append(("work", add * (len(st.peers) - 1), "reduce",
                             f"{job}:{spec.op} add slot {st.slot}"))
            elif isinstance(st, S.Post):
                prog.append(("post", tuple(
                    ((job, r, t.peer, t.tag), True, xb) if t.kind == "send"
                    else ((job, t.peer, r, t.tag), False, xb) for t in st.transfers)))
            elif isinstance(st, S.Wait):
                t = st.transfer
                key = (job, r, t.peer, t.tag) if t.kind == "send" else (job, t.peer, r, t.tag)
                prog.append(("wait", key))
            elif isinstance(st, S.Collective):
                key = (job, st.slot)
                if key not in self.coll_time:
                    self.coll_time[key] = (hw.collective_time(
                        c.collective, c.collective_bytes, self.w) if self.comm else 0.0,
                        f"{job}:{spec.op} {c.collective} chunk {st.slot}")
                prog.append(("coll", key))
            else:
                prog.append(("wcoll", (job, st.slot)))

    # -- event loop ---------------------------------------------------------------------------
    def run(self):
        w = self.w
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
        for r in range(w):
            self._advance(r)
        while self.heap:
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
                for key, is_send, nbytes in ins[1]:
                    f = self.flows.get(key)
                    if f is None:
                        f = self.flows[key] = _Flow(key, key[1], key[2], nbytes,
                                                    f"{key[0]}:tag {key[3]} {key[1]}->{key[2]}")
                    f.posted += 1
                    if f.posted == 2:
                        self._start_flow(f)
            elif kind == "wait":
                f = self.flows[ins[1]]
                if not f.done:
                    f.waiters.append(r)
                    self.blocked[r] = (self.now, f"wait {f.label}")
                    return
            elif kind == "coll":
                c = self.colls.setdefault(ins[1], [0, False, [], 0.0])
                c[0] += 1
                if c[0] == self.w:  # collectives run one at a time, in launch order
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
        """Recompute the rates of every draining flow touching ranks a or b, and their compute."""
        seen: dict = {}
        for r in (a, b):
            seen.update(self.out[r])
            seen.update(self.inn[r])
        now = self.now
        for f in seen:
            rate = self._flow_rate(f)
            if rate != f.rate:
                f.left = max(f.left - (now - f.t) * f.rate, 0.0)
                f.t, f.rate, f.ver = now, rate, f.ver + 1
                self._push(now + f.left / rate, 1, f, f.ver)
        self._retime_task(a)
        if b != a:
            self._retime_task(b)

    def _start_flow(self, f: _Flow) -> None:
        f.start = f.t = self.now
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
        self._push(self.now + self.hw.link_latency, 2, f)

    def _flow_done(self, f: _Flow) -> None:
        f.done = True
        if self.comm:
            self._span(f.src, "send", f.label, f.start, self.now)
            self._span(f.dst, "recv", f.label, f.start, self.now)
        for r in f.waiters:
            self._wake(r)

    def _start_coll(self, key, c) -> None:
        c[3] = self.now
        duration = self.coll_time[key][0]
        if duration > 0:
            for r in range(self.w):
                self.ncoll[r] += 1
                self._retime_task(r)
        self._push(self.now + duration, 3, key)

    def _coll_done(self, key) -> None:
        c = self.colls[key]
        c[1] = True
        duration, label = self.coll_time[key]
        if duration > 0:
            for r in range(self.w):
                self.ncoll[r] -= 1
                self._retime_task(r)
                self._span(r, "collective", label, c[3], self.now)
        self.coll_queue.pop(0)
        if self.coll_queue:
            nxt = self.coll_queue[0]
            self._start_coll(nxt, self.colls[nxt])
        for r in c[2]:
            self._wake(r)

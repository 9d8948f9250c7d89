"""The CUDA transport's ordering, checked on CPU with a recording fake of CUDA and NCCL.

The fake (`FakeCuda`) keeps a happens-before graph: each stream is a chain of nodes, an event
is the node its stream had reached, ``wait_event`` adds an edge, and an NCCL batch is a node on
the group's NCCL stream that (as ProcessGroupNCCL does) also waits for the stream current when
it is issued; ``work.wait()`` makes the current stream wait for the batch. Real schedules run
through `commfuse.runtime.executor.run` with a binding whose GEMMs are nodes on the compute
stream; the checks then read, per batch and per GEMM, what it waits for.
"""

import contextlib
import re
import gc
import threading
import time
import weakref

import pytest
import torch

from commfuse import schedule as S
from commfuse.errors import CommFuseError
from commfuse.runtime import deadlines, executor
from commfuse.runtime.cuda import Backend, CudaTransport


class Node:
    def __init__(self, label, preds):
        self.label, self.preds = label, [p for p in preds if p is not None]

    def ancestors(self) -> set:
        seen, todo = {}, list(self.preds)
        while todo:
            n = todo.pop()
            if id(n) not in seen:
                seen[id(n)] = n
                todo += n.preds
        return set(seen.values())


class FakeStream:
    def __init__(self, name):
        self.name, self.last = name, None

    def add(self, label, *preds) -> Node:
        self.last = Node(label, [self.last, *preds])
        return self.last


class FakeWork:
    def __init__(self, cuda, node):
        self.cuda, self.node = cuda, node  # holds no tensor: what keeps buffers is the transport
        self.polls, self.completes = [], True  # polls: the thread of each is_completed

    def is_completed(self) -> bool:
        self.polls.append(threading.get_ident())
        return self.completes

    def wait(self, timeout=None):
        self.cuda.current.add(f"wait {self.node.label}", self.node)
        return True


class FakeCuda:
    """`commfuse.runtime.cuda.Backend` with streams, events and NCCL batches as graph nodes."""

    def __init__(self):
        self.compute, self.comm, self.nccl = (FakeStream(n) for n in ("compute", "comm", "nccl"))
        self.current = self.compute
        self.batches: list[Node] = []
        self.log: list[tuple] = []  # ("begin",) comm waiting for compute, ("issue",), ("alloc", t)
        self.never_complete = False

    def comm_stream(self, device):
        return self.comm

    def current_stream(self, device):
        return self.current

    @contextlib.contextmanager
    def use(self, stream):
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved

    def record_event(self, stream):
        return stream.last  # an event is the node its stream had reached

    def wait_event(self, stream, event):
        if stream is self.comm and event is self.compute.last:
            self.log.append(("begin",))
        stream.add("wait event", event)

    def issue(self, group, transfers):
        if not transfers:  # as dist.batch_isend_irecv([]) does
            raise IndexError("list index out of range")
        self.log.append(("issue",))
        label = "batch " + ", ".join(f"{t.kind} {t.slot}" for t, _ in transfers)
        node = self.nccl.add(label, self.current.last)  # NCCL syncs with the current stream
        node.transfers = [t for t, _ in transfers]
        self.batches.append(node)
        node.work = FakeWork(self, node)
        node.work.completes = not self.never_complete
        return node.work

    def kernel(self, label):
        return self.current.add(label)


class FakeBinding:
    """An op's binding reduced to what the ordering needs, with its buffers laid out as the
    real bindings do (`commfuse.ops`): GEMMs and adds are kernels; gather-side sends read the
    input (ag_matmul receives land in the same gathered tensor, so a forward sends what a
    receive wrote), reduce-side sends read the partial their GEMM produced; receives that the
    real binding allocates during the op are fresh tensors (the stream current is noted)."""

    def __init__(self, cuda, op, rows=lambda slot: 2):
        self.cuda, self.op, self.rows = cuda, op, rows
        self.full = torch.zeros(64, 8)  # ag_matmul's gathered A / matmul_a2a's output
        self.inp = torch.zeros(64, 8)  # a2a_matmul's input
        self.part = {}  # reduce side: slot -> partial
        self.allocs = []  # (transfer, stream current at allocation)
        self.kernels = {}  # label -> node

    def buffer(self, t):
        self.allocs.append((t, self.cuda.current))
        self.cuda.log.append(("alloc", t))
        n = self.rows(t.slot)
        view = slice(8 * t.slot, 8 * t.slot + n)
        if self.op in ("ag_matmul", "matmul_a2a") and (t.kind == "recv") == (self.op == "matmul_a2a"):
            return self.full[view]
        if self.op == "ag_matmul":  # ag_matmul sends and receives in the gathered tensor
            return self.full[view]
        if t.kind == "send":
            return self.inp[view] if self.op == "a2a_matmul" else self.part[t.slot][:n]
        return torch.zeros(n, 8)

    def compute(self, slot):
        self.kernels[f"gemm {slot}"] = self.cuda.kernel(f"gemm {slot}")
        self.part[slot] = torch.zeros(8, 8)

    def reduce(self, slot, peers):
        self.kernels[f"add {slot}"] = self.cuda.kernel(f"add {slot}")
        self.part[slot] = torch.zeros(8, 8)  # the sum, a new tensor


class WaitStreamDesign(CudaTransport):
    """The design before issue #13: the comm stream waits for the whole compute stream
    (``comm.wait_stream(current)``) before each batch; kept to show the checks can fail."""

    def post(self, transfers):
        self.cuda.wait_event(self.comm, self.cuda.record_event(self.compute))
        with self.cuda.use(self.comm):
            work = self.cuda.issue(self.group, transfers)
        return [work] * len(transfers)


def run(op, topology, world, rank, cls=CudaTransport, timeout_s=None, rows=lambda s: 2, m=1,
        method="commfuse"):
    cuda = FakeCuda()
    binding = FakeBinding(cuda, op, rows)
    transport = cls(None, torch.device("cpu"), timeout_s, backend=cuda)
    sched = S.build(op, method, world, rank, topology=topology, splits=m)
    executor.run(sched, binding, transport)
    return cuda, binding, transport, sched


def check_order(op, topology, world, rank, cls=CudaTransport, m=1, method="commfuse"):
    """Every batch waits for the data it sends and for nothing the compute stream queued
    after that data; every GEMM/add waits for the receive it consumes and no later one."""
    cuda, binding, transport, sched = run(op, topology, world, rank, cls, m=m, method=method)
    kernels = binding.kernels
    order = [s.slot for s in sched.steps if isinstance(s, S.Compute)]
    recv_batch = {t.slot: b for b in cuda.batches for t in b.transfers if t.kind == "recv"}
    for b in cuda.batches:
        anc = b.ancestors()
        for t in b.transfers:
            if t.kind != "send":
                continue
            if op in S.GATHER_SIDE:  # sends input data or what a receive brought
                assert not any(n.label.startswith("gemm") for n in anc), \
                    f"{b.label} waits for a GEMM: {sorted(n.label for n in anc)}"
                if op == "ag_matmul" and recv_batch.get(t.slot, b) is not b:
                    assert recv_batch[t.slot] in anc, f"{b.label}: forwards before its receive"
            else:  # sends what its GEMM (and add) produced: waits for it
                need = kernels.get(f"add {t.slot}", kernels[f"gemm {t.slot}"])
                assert need in anc, f"{b.label} does not wait for its data"
                later = order[order.index(t.slot) + 1:]
                assert not any(kernels[f"gemm {s}"] in anc for s in later)
    for label, node in kernels.items():
        anc = node.ancestors()
        slot = int(label.split()[1])
        consumes = (label.startswith("gemm") and op in S.GATHER_SIDE) or label.startswith("add")
        for s, b in recv_batch.items():
            if consumes and s == slot:
                assert b in anc, f"{label} does not wait for the receive of slot {slot}"
            elif s != slot and op in S.GATHER_SIDE and order.index(s) > order.index(slot):
                assert b not in anc, f"{label} waits for the later receive of slot {s}"
    return cuda, binding, transport


CASES = [(op, topo, w, r) for op in S.OPS for topo in S.TOPOLOGIES for w in (2, 3, 4)
         for r in range(w)]


@pytest.mark.parametrize("op,topology,world,rank", CASES)
def test_each_batch_waits_for_its_own_data_only(op, topology, world, rank):
    check_order(op, topology, world, rank)


@pytest.mark.parametrize("op", S.OPS)
def test_decompose_batches_wait_for_their_own_data_only(op):
    """decompose posts after computes: a gather-side send (input data, its slot numbered
    otherwise than the computes' in a2a_matmul and direct ag_matmul) waits for no GEMM."""
    for topology in S.TOPOLOGIES:
        for world in (2, 3, 4):
            for rank in range(world):
                check_order(op, topology, world, rank, method="decompose")


@pytest.mark.parametrize("m", [2, 3])
def test_order_with_sub_slices(m):
    for op in S.OPS:
        check_order(op, "ring", 4, 1, m=m)


def test_the_old_wait_stream_design_fails_the_check():
    """The ring forward under ``comm.wait_stream(current)`` waits for the GEMM queued before."""
    with pytest.raises(AssertionError, match="waits for a GEMM"):
        check_order("ag_matmul", "ring", 3, 0, cls=WaitStreamDesign)


@pytest.mark.parametrize("op", S.OPS)
def test_receive_buffers_are_allocated_on_compute_before_the_transport_begins(op):
    """Every receive buffer is asked of the binding with the compute stream current, before
    the comm stream waits for the compute stream's point that precedes every batch; nothing
    calls ``record_stream`` (the Backend has none)."""
    for topology in S.TOPOLOGIES:
        cuda, binding, transport = check_order(op, topology, 4, 2)
        recvs = [(t, s) for t, s in binding.allocs if t.kind == "recv"]
        assert recvs and all(s is cuda.compute for _, s in recvs)
        log = cuda.log
        first_issue = log.index(("issue",))
        last_alloc = max(i for i, e in enumerate(log) if e[0] == "alloc" and e[1].kind == "recv")
        assert any(log[i] == ("begin",) for i in range(last_alloc + 1, first_issue)), \
            "the transport began before a receive buffer was allocated"
        assert not hasattr(Backend, "record_stream") and not transport.held


def test_buffers_stay_referenced_until_their_work_is_waited():
    cuda = FakeCuda()
    transport = CudaTransport(None, torch.device("cpu"), None, backend=cuda)
    send, recv = S.Transfer("send", 0, 1, 0), S.Transfer("recv", 1, 1, 0)
    bufs = [torch.zeros(3), torch.zeros(3)]
    refs = [weakref.ref(b) for b in bufs]
    works = transport.post(list(zip((send, recv), bufs)))
    del bufs
    gc.collect()
    assert all(r() is not None for r in refs), "a buffer was released before its transfer"
    transport.wait(works[0])
    del works
    gc.collect()
    assert all(r() is None for r in refs), "buffers outlive the wait of their transfer"


class FakeGroup:
    """A communicator's group, labelled as a fake: ``abort()`` notes when it is called."""

    def __init__(self, log):
        self.log, self.aborted = log, False

    def abort(self):
        time.sleep(0.05)  # an abort that takes a while: the error must still come after it
        self.aborted = True
        self.log.append("abort")


def _late_run(timeout_s=0.05):
    """matmul_rs on 3 ranks whose batches never complete, with a deadline: returns the fake,
    the group, the event log and the host's time in the op."""
    cuda, log = FakeCuda(), []
    cuda.never_complete = True
    group = FakeGroup(log)
    transport = CudaTransport(group, torch.device("cpu"), timeout_s, backend=cuda)
    sched = S.build("ag_matmul", "commfuse", 3, 0)
    t0 = time.monotonic()
    executor.run(sched, FakeBinding(cuda, sched.op), transport)
    return cuda, group, log, time.monotonic() - t0


def _raised(group, log):
    """The next op on ``group`` (a transport made for it): its CommFuseError, noted in ``log``."""
    with pytest.raises(CommFuseError) as err:
        CudaTransport(group, torch.device("cpu"), 1.0, backend=FakeCuda())
    log.append("raise")
    return err.value


def test_a_deadline_never_blocks_the_host():
    """With a timeout, every wait is stream-ordered: the op returns at once, every poll of a
    work is the watchdog thread's, never the host's."""
    cuda, group, log, took = _late_run(timeout_s=5.0)
    assert took < 1.0 and cuda.batches
    me = threading.get_ident()
    assert all(me not in b.work.polls for b in cuda.batches)
    cuda.never_complete = False
    for b in cuda.batches:
        b.work.completes = True
    end = time.monotonic() + 5
    while deadlines.WATCHDOG.pending() and time.monotonic() < end:
        time.sleep(0.01)
    assert deadlines.WATCHDOG.pending() == 0  # completed works are let go (their buffers too)
    assert any(b.work.polls for b in cuda.batches) and log == []  # polled; nothing aborted


def test_a_late_transfer_aborts_the_communicator_before_the_error():
    """Past its deadline a transfer's group is aborted (the fake's ``abort``), and only then
    does the host's next op on that group raise `CommFuseError` naming the op, step and peer."""
    cuda, group, log, took = _late_run(timeout_s=0.05)
    assert took < 1.0
    end = time.monotonic() + 5
    while not group.aborted and time.monotonic() < end:
        time.sleep(0.01)
    err = _raised(group, log)
    assert log == ["abort", "raise"]
    assert err.op == "ag_matmul" and err.rank == 0 and err.peer is not None
    assert re.search(r"ag_matmul \(method=commfuse, rank 0 of 3\) failed at step \d+ waiting "
                     r"for (send|recv) of slot \d+ (to|from) rank \d.*did not complete within "
                     r"0.05 s.*aborted", str(err))
    _raised(group, log)  # the communicator is gone: every later op on it raises too
    ok = FakeGroup([])  # another group is not touched
    CudaTransport(ok, torch.device("cpu"), 1.0, backend=FakeCuda())


def test_the_error_waits_for_a_slow_abort():
    """An op that starts while the abort is still running does not raise early: the error
    exists only once the abort returned."""
    cuda, log = FakeCuda(), []
    group = FakeGroup(log)
    dog = deadlines.Watchdog(poll_s=0.001)
    dog.watch(FakeWork(cuda, cuda.nccl.add("x")), group, 0.0)
    dog.entries[0].work.completes = False
    end = time.monotonic() + 5
    while group.log == [] and time.monotonic() < end:
        try:
            dog.raise_failed(group)
        except CommFuseError:
            log.append("raise")
        time.sleep(0.001)
    assert log[0] == "abort"


def test_deadlines_stay_below_the_group_timeout(monkeypatch):
    monkeypatch.setattr(deadlines.gloo, "group_timeout", lambda group, device: 60.0)
    assert deadlines.deadline_s(60.0, None, torch.device("cuda")) == pytest.approx(54.0)
    assert deadlines.deadline_s(5.0, None, torch.device("cuda")) == 5.0


def test_no_deadline_waits_on_the_stream_without_polling():
    cuda = FakeCuda()
    transport = CudaTransport(None, torch.device("cpu"), None, backend=cuda)
    executor.run(S.build("matmul_rs", "commfuse", 3, 1), FakeBinding(cuda, "matmul_rs"),
                 transport)
    assert cuda.batches and transport.held == {}
    assert all(not b.work.polls for b in cuda.batches)


@pytest.mark.parametrize("op", S.OPS)
@pytest.mark.parametrize("topology", S.TOPOLOGIES)
def test_steps_with_nothing_to_move_post_nothing(op, topology):
    """2 rows over 4 ranks (1, 1, 0, 0): some steps send and receive only empty slices; NCCL
    refuses an empty batch (the fake raises as ``batch_isend_irecv([])`` does)."""
    sizes = (1, 1, 0, 0)
    for rank in range(4):
        cuda, _, transport, _ = run(op, topology, 4, rank, rows=lambda s: sizes[s % 4])
        assert all(b.transfers for b in cuda.batches)


def _sparse_on_gloo(rank, world):
    """2 rows over 4 gloo ranks, every op with commfuse ring and direct: exact, and no post
    is ever handed an empty list."""
    from commfuse.runtime import transport as tr
    from dist_cases import Case, check

    empty, post = [], tr.Transport.post
    tr.Transport.post = lambda self, transfers: empty.append(1) if not transfers else post(self, transfers)
    out = {}
    for op in S.OPS:
        for method, opts in (("commfuse", {}), ("commfuse", {"topology": "direct"}),
                             ("decompose", {})):
            case = Case(op, method, tuple(opts.items()), 0, torch.float32, uneven="sparse")
            out[case.id] = check(case, rank, world)
    return out, len(empty)


def test_steps_with_nothing_to_move_on_gloo():
    from commfuse.testbed.spawn import run_local

    for rank, (res, empty) in enumerate(run_local(_sparse_on_gloo, 4, timeout=120)):
        assert not {k: v for k, v in res.items() if v}, (rank, res)
        assert empty == 0, f"rank {rank} posted {empty} empty batches"


def test_gradient_reduce_scatter_sends_its_finished_partials(monkeypatch):
    """`GradReduce` (ZeRO-3 prefetch) computes the peers' partials, then posts them: on CUDA
    the batch must wait for those GEMMs (its transport is made after them)."""
    from types import SimpleNamespace

    from commfuse.parallel.prefetch import GradReduce
    from commfuse.runtime import modes

    cuda, gemm, count = FakeCuda(), modes.gemm, [0]

    def traced_gemm(a, b, out=None):  # each GEMM a kernel on the compute stream
        cuda.kernel(f"gemm {count[0]}")
        count[0] += 1
        return gemm(a, b, out)

    monkeypatch.setattr(modes, "gemm", traced_gemm)
    group = SimpleNamespace(size=lambda: 3, rank=lambda: 1, commfuse_backend=cuda)
    mod = SimpleNamespace(group=group, weight=torch.nn.Parameter(torch.zeros(2, 4)), what="w")
    GradReduce(mod, torch.ones(6, 5), torch.ones(5, 4), None)
    (batch,) = cuda.batches
    anc = {n.label for n in batch.ancestors()}
    assert {"gemm 0", "gemm 1"} <= anc, f"the batch does not wait for the partials: {anc}"
    assert "gemm 2" not in anc  # the own partial, computed after the post, is not sent



@pytest.mark.parametrize("env,high", [(None, True), ("1", True), ("0", False)])
def test_communication_streams_are_high_priority_unless_switched_off(env, high, monkeypatch):
    """commfuse's comm stream (a fake torch.cuda.Stream noting its arguments) and the NCCL
    options of the groups commfuse creates (a fake ProcessGroupNCCL.Options: this CPU build
    has no NCCL) follow ``COMMFUSE_HIGH_PRIORITY_COMM``; gloo groups get no options."""
    from types import SimpleNamespace

    from commfuse.runtime import cuda as cuda_mod
    from commfuse.testbed.spawn import pg_options

    if env is None:
        monkeypatch.delenv("COMMFUSE_HIGH_PRIORITY_COMM", raising=False)
    else:
        monkeypatch.setenv("COMMFUSE_HIGH_PRIORITY_COMM", env)
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: made.append(kw) or kw)
    Backend().comm_stream(torch.device("cuda", 0))
    assert made == [{"device": torch.device("cuda", 0), "priority": -1 if high else 0}]

    class FakeOptions:  # ProcessGroupNCCL.Options, faked
        is_high_priority_stream = False

    monkeypatch.setattr(cuda_mod.dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(cuda_mod.dist, "ProcessGroupNCCL", SimpleNamespace(Options=FakeOptions),
                        raising=False)
    assert pg_options("nccl").is_high_priority_stream is high
    assert pg_options("gloo") is None and cuda_mod.comm_options("gloo") is None

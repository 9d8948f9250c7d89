"""The training step of issue #12 in the simulator (commfuse.sim.step.ops.StepModel): the
vocabulary-parallel head and embedding, the re-gathering / streaming backwards of the fused
ops, the bucketed gradient sync, the step's limit, and commfuse's chosen splits."""

import pytest

from commfuse import sim
from commfuse.models.llama import LlamaConfig
from commfuse.parallel.config import ParallelDims
from commfuse.sim.choose import best_splits
from commfuse.sim.step.ops import (FUSED, StepModel, StepOp, block_ops, embed_ops,
                                    grad_sync_ops, head_ops, wire_bytes)
from commfuse.sim.step.timing import OpTimer, _buckets, bucketed_exposed, simulate_step

HW = sim.Hardware(gemm_flops=100e12, link_bandwidth=50e9, link_latency=5e-6,
                  mem_bandwidth=2e12, m0=64.0, n0=64.0, k0=64.0, interference=0.1)
CFG = LlamaConfig(vocab_size=512, dim=256, n_layers=3, n_heads=8, n_kv_heads=4, ffn_hidden=512,
                  max_seq_len=1024)
PREV, NEW = StepModel.previous(), StepModel()
D, V, F, L = CFG.dim, CFG.vocab_size, CFG.ffn_hidden, CFG.n_layers


def dims(tp=1, up=1, dp=1, method="commfuse", **opts):
    return ParallelDims(tp=tp, up=up, dp=dp, method=method, method_opts=opts,
                        world_size=tp * up * dp)


def flops(op):
    return 0.0 if op.kind not in FUSED + ("gemm",) else 2 * op.count * op.shape[0] \
        * op.shape[1] * op.shape[2]


def by_name(ops):
    return {o.name: o for o in ops}


def test_step_model_validation_and_defaults():
    assert NEW.grad_sync == "bucketed" and NEW.vocab_parallel and NEW.bucket_mb == 25.0
    assert (PREV.grad_sync, PREV.vocab_parallel, PREV.ag_backward, PREV.rs_backward) == \
        ("end", False, "save", "after")
    for bad in ({"grad_sync": "later"}, {"ag_backward": "x"}, {"rs_backward": "x"},
                {"bucket_mb": 0}):
        with pytest.raises(ValueError, match="StepModel"):
            StepModel(**bad)


@pytest.mark.parametrize("tp,up", [(2, 1), (1, 4)])
def test_vocab_parallel_head_and_loss(tp, up):
    T, n, ax = tp * up, 2 * 64, "tp" if tp > 1 else "up"
    fwd, bwd = head_ops(CFG, tp, up, 1, 64, 2, True, 4, NEW)
    f = by_name(fwd)
    assert f["output"] == StepOp("output", "ag_matmul", ax, (n, D, V // T))  # all tokens, V/T
    assert f["loss max"].kind == f["loss sum"].kind == "all_reduce"
    assert (f["loss max"].shape[0], f["loss sum"].shape[0]) == (n * 4, 2 * n * 4)  # [n], [2, n]
    assert {o.name: o.kind for o in bwd} == {"output dx": "matmul_rs", "output dW": "ag_matmul"}
    old_f, old_b = head_ops(CFG, tp, up, 1, 64, 2, True, 4, PREV)
    # the same FLOPs over the group: V/T columns of all n tokens against V of n/T
    assert T * sum(map(flops, fwd + bwd)) == pytest.approx(T * sum(map(flops, old_f + old_b)))
    # bytes one rank sends: the hidden gathered twice (forward, dW), dlogits @ W scattered
    assert wire_bytes(f["output"], T, 4) == (T - 1) / T * n * D * 4
    assert wire_bytes(f["loss sum"], T, 4) == 2 * (T - 1) / T * 2 * n * 4


def test_vocab_parallel_embedding_and_no_vocab_grad_all_reduce():
    n = 2 * 64
    ef, eb = embed_ops(CFG, 2, 1, 64, 2, True, 4, NEW)
    assert [(o.kind, o.axis, o.shape) for o in ef + eb] == \
        [("reduce_scatter", "tp", (n * D * 4,)), ("all_gather", "tp", (n * D * 4,))]
    assert embed_ops(CFG, 2, 1, 64, 2, True, 4, PREV) == ([], [])
    assert embed_ops(CFG, 1, 1, 64, 2, True, 4, NEW) == ([], [])
    norms = (2 * L + 1) * D * 4
    assert [o.shape[0] for o in grad_sync_ops(CFG, 2, 1, 1, 4, NEW)] == [norms]
    old = grad_sync_ops(CFG, 2, 1, 1, 4, PREV)
    assert [o.shape[0] for o in old] == [norms + 2 * V * D * 4]  # embedding and head
    # under DP the embedding's V/T rows are still all-reduced over dp, the head is ZeRO-3
    sync = {o.axis: o.shape[0] for o in grad_sync_ops(CFG, 2, 1, 2, 4, NEW)}
    assert sync["dp"] == V // 2 * D * 4 and sync["world"] == norms
    hf, hb = head_ops(CFG, 2, 1, 2, 64, 1, True, 4, NEW)
    assert by_name(hf)["gather output"].shape == (V // 2 * D * 4,)
    assert by_name(hb)["grad RS output"].kind == "reduce_scatter"


def test_regather_and_streaming_backwards():
    t, n = 2, 64
    _, new = block_ops(CFG, t, 1, 1, n, 1, True, 4, NEW)
    _, old = block_ops(CFG, t, 1, 1, n, 1, True, 4, PREV)
    b, o = by_name(new), by_name(old)
    # AG->GEMM backward: dW on A gathered again, an AG->GEMM of the forward's shape
    assert b["gate|up dW"] == StepOp("gate|up dW", "ag_matmul", "tp", (n, D, 2 * F // t))
    assert flops(b["gate|up dW"]) == flops(o["gate|up dW"])
    assert wire_bytes(b["gate|up dW"], t, 4) == (t - 1) / t * n * D * 4
    # GEMM->RS backward: dx and dW per arriving slice of dC, one AG->GEMM of 2k columns
    assert b["down dx+dW"] == StepOp("down dx+dW", "ag_matmul", "tp", (n, D, 2 * F // t))
    assert flops(b["down dx+dW"]) == flops(o["down dx"]) + flops(o["down dW"])
    assert wire_bytes(b["down dx+dW"], t, 4) == wire_bytes(o["down dx"], t, 4)
    assert sum(map(flops, new)) == pytest.approx(sum(map(flops, old)))
    # ZeRO-3: dx on the weight rows gathered again
    _, z = block_ops(CFG, 1, 1, 2, n, 1, True, 4, NEW)
    assert by_name(z)["w_up dx"] == StepOp("w_up dx", "ag_matmul", "dp", (F, D, n))


def test_bucket_accounting():
    assert bucketed_exposed([], 1.0) == 0.0
    assert bucketed_exposed([[1.0, 1.0, 0.5]], 10.0) == 0.5  # all but the last hidden
    assert bucketed_exposed([[1.0, 1.0, 0.5]], 1.0) == 1.5  # 2.5 s of sync, 1 s to hide in
    assert bucketed_exposed([[0.2], [1.0, 0.3]], 5.0) == 0.3  # the longest last bucket
    mib = 2 ** 20
    op = StepOp("g", "all_reduce", "dp", (60 * mib,))
    times = _buckets(op, (4, HW), 25.0)
    ar = lambda b: 2 * HW.collective_time("reduce_scatter", b, 4)
    assert times == [ar(25 * mib), ar(25 * mib), ar(10 * mib)]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, dp=2), dict(up=2), dict(dp=4)])
def test_bucketed_sync_hides_behind_backward(layout):
    kw = dict(seq=256, batch=4)
    d = dims(**layout)
    end = simulate_step(CFG, d, HW, step_model=StepModel(grad_sync="end"), **kw)
    bucketed = simulate_step(CFG, d, HW, **kw)
    sync = [(op, n, t) for op, n, t, *_ in end.rows if op.name.startswith("grad all-reduce")]
    assert end.sync_exposed_s == pytest.approx(sum(t for _, _, t in sync))
    assert bucketed.sync_exposed_s <= end.sync_exposed_s
    assert bucketed.step_s == pytest.approx(end.step_s - end.sync_exposed_s
                                            + bucketed.sync_exposed_s)
    assert bucketed.step_s == pytest.approx(sum(bucketed.breakdown.values()))
    assert bucketed.sync_exposed_s > 0  # the last bucket always shows


def test_step_limit():
    for layout in (dict(tp=2), dict(tp=2, dp=2), dict(up=2), dict(dp=2)):
        r = simulate_step(CFG, dims(**layout), HW, seq=256, batch=4)
        assert r.limit_s <= r.step_s * (1 + 1e-9)
        assert r.limit_s == pytest.approx(max(r.compute_s, r.comm_s))  # one kind of link
        assert r.comm_s > 0
    one = simulate_step(CFG, dims(), HW, seq=256)
    assert one.comm_s == 0 and one.limit_s == one.compute_s == pytest.approx(one.step_s)
    # across nodes: each link's bytes are a budget of its own
    r = simulate_step(CFG, dims(tp=2, dp=2), HW, seq=256, batch=4, inter_hw="multinode-100g",
                      node_size=2)
    assert max(r.compute_s, r.comm_s) >= r.limit_s >= r.compute_s


def test_commfuse_without_splits_takes_the_model_choice():
    timer = OpTimer(4)
    op = StepOp("q|k|v", "ag_matmul", "tp", (4096, 1024, 1024))
    hw = sim.preset("cpu-testbed")
    m = best_splits("ag_matmul", op.shape, 2, 4, hw, timer.auto_step_s)
    assert m > 1
    assert timer.time(op, "commfuse", {}, 2, hw)[2] == f"commfuse splits={m}"
    assert timer.time(op, "commfuse", {"splits": 1}, 2, hw)[2] == "commfuse splits=1"


def test_both_steps_predicted_and_the_new_one_default():
    d = dims(tp=2)
    new = simulate_step("tiny", d, "cpu-testbed", seq=128, batch=8, micro_batch=8, dtype_bytes=4)
    old = simulate_step("tiny", d, "cpu-testbed", seq=128, batch=8, micro_batch=8, dtype_bytes=4,
                        step_model=PREV)
    names = lambda r: {op.name for op, *_ in r.rows}
    assert {"loss max", "embedding", "down dx+dW"} <= names(new)
    assert not {"loss max", "embedding", "down dx+dW"} & names(old)
    assert new.step_s != old.step_s and new.tokens == old.tokens == 8 * 128

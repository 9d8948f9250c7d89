"""The backward's cross-op prefetch of AG->GEMM re-gathers (`commfuse.ops.prefetch`).

Pure: the plan (`commfuse.schedule.prefetch.prefetch_plan`) posts ahead only what needs this rank's own
slice, and every step runs once. On 2, 3 and 4 gloo ranks, every method: the TP model with the
prefetch gives bit-identical logits, loss and gradients to the same model without it (the same
GEMMs in the same slot order), both within tolerance of the unsharded model, and the
prefetch really ran; a prefetched gather that is never consumed (a backward cut off by
``inputs=``, a retained graph run twice, depth 1 with two posts in flight) neither hangs nor
desyncs the next steps, which still equal a fresh model's.
"""

import copy
import dataclasses
import functools

import pytest
import torch

from commfuse import schedule
from commfuse.models.llama import Llama, LlamaConfig
from commfuse.ops.fused import fused_all_gather_matmul, fused_matmul_reduce_scatter
from commfuse.ops.prefetch import Prefetcher
from commfuse.parallel import ParallelDims, parallelize
from commfuse.schedule.prefetch import early_steps, prefetch_plan
from commfuse.testbed.spawn import run_local

# --- the plan, no processes --------------------------------------------------------------------

PLANS = [(m, t, s, w, r) for m, t, s in (("commfuse", "direct", 1), ("commfuse", "direct", 2),
                                         ("commfuse", "ring", 1), ("decompose", "direct", 1),
                                         ("none", "ring", 1), ("sliced", "ring", 1))
         for w in (2, 3, 4) for r in range(w)]


@pytest.mark.parametrize("method,topology,splits,world,rank", PLANS)
def test_plan_posts_only_own_data_ahead_and_runs_every_step_once(method, topology, splits,
                                                                  world, rank):
    g = schedule.build("ag_matmul", method, world, rank, topology=topology, chunks=3,
                       splits=splits)
    plan = prefetch_plan(g)
    assert sorted(plan.early + plan.late) == list(range(len(g.steps)))
    assert list(plan.early) == sorted(plan.early) and list(plan.late) == sorted(plan.late)
    m = g.chunks // world
    for i in plan.early:
        step = g.steps[i]
        assert isinstance(step, (schedule.Post, schedule.Collective))
        if isinstance(step, schedule.Post):
            assert all(t.kind == "recv" or t.slot // m == rank for t in step.transfers)
    late_waits = [g.steps[i] for i in plan.late
                  if isinstance(g.steps[i], (schedule.Wait, schedule.WaitCollective))]
    assert len(late_waits) == sum(isinstance(s, (schedule.Wait, schedule.WaitCollective))
                                  for s in g.steps)  # nothing is waited ahead
    if topology == "direct" or method in ("none", "sliced"):  # everything moves ahead
        assert not any(isinstance(g.steps[i], (schedule.Post, schedule.Collective))
                       for i in plan.late)
    # the computes keep their order: the weight-gradient sums are the same
    assert [g.steps[i] for i in plan.late if isinstance(g.steps[i], schedule.Compute)] == \
        [s for s in g.steps if isinstance(s, schedule.Compute)]


def test_plan_is_posted_after_the_producers_last_post_and_says_so():
    producer = schedule.build("ag_matmul", "commfuse", 3, 0, topology="ring")
    plan = prefetch_plan(schedule.build("ag_matmul", "commfuse", 3, 0,
                                                 topology="direct"), producer)
    assert plan.at == max(i for i, s in enumerate(producer.steps)
                          if isinstance(s, schedule.Post))
    lines = plan.describe().splitlines()
    first_prefetch = next(i for i, line in enumerate(lines) if "prefetch" in line)
    assert first_prefetch == plan.at + 1
    assert sum("prefetch" in line for line in lines) == len(plan.early)
    with pytest.raises(ValueError, match="gather-side"):
        early_steps(schedule.build("matmul_rs", "commfuse", 2, 0))


def test_prefetcher_rejects_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(-1)
    with pytest.raises(ValueError, match="regather_prefetch"):
        ParallelDims(tp=2, world_size=2, regather_prefetch=True)


def test_step_model_hides_the_prefetched_regather_behind_the_attention_backward():
    from commfuse import sim
    from commfuse.sim.step.ops import StepModel, block_ops
    from commfuse.sim.step.timing import prefetch_credit, simulate_step

    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4,
                      ffn_hidden=512, max_seq_len=1024)
    hw = sim.Hardware(gemm_flops=1e12, link_bandwidth=1e9, link_latency=5e-6,
                      mem_bandwidth=1e11, m0=64.0, n0=64.0, k0=64.0, interference=0.0)
    _, bwd = block_ops(cfg, 2, 1, 1, 1024, 2, True, 4, StepModel())
    credit = prefetch_credit(bwd)
    assert {op.name: [g.name for g in hide] for op, hide in credit.items()} == \
        {"gate|up dW": [], "q|k|v dW": ["attention bwd"]}
    names = [op.name for op in bwd]  # the code's order: re-gather (dW) then the RS of dx
    assert names.index("q|k|v dW") < names.index("q|k|v dx")
    step = {p: simulate_step(cfg, ParallelDims(tp=2, world_size=2, regather_prefetch=p), hw,
                             seq=1024, batch=2, micro_batch=2, dtype_bytes=4)
            for p in (0, 1)}
    assert step[1].step_s < step[0].step_s  # the re-gather was exposed here, now partly hidden
    assert step[1].compute_s == step[0].compute_s and step[1].step_s >= step[1].compute_s
    off = simulate_step(cfg, ParallelDims(tp=2, world_size=2), hw, seq=1024, batch=2,
                        micro_batch=2, dtype_bytes=4,
                        step_model=StepModel(regather_prefetch=False))
    assert off.step_s == pytest.approx(step[0].step_s)


# --- the TP model on 2, 3, 4 ranks --------------------------------------------------------------

BASE = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
            max_seq_len=16)
CFGS = {2: BASE, 3: {**BASE, "dim": 48, "n_heads": 6, "n_kv_heads": 3, "ffn_hidden": 96,
                     "vocab_size": 66}, 4: {**BASE, "n_kv_heads": 4}}
METHODS = (("none", {}), ("sliced", {"chunks": 2}), ("decompose", {}),
           ("commfuse", {"topology": "ring"}), ("commfuse", {"topology": "direct"}),
           ("commfuse", {"splits": 2}), ("auto", {}))
# query-split attention: its backward posts q|k|v's re-gather (True: on for the method)
QUERY_SPLIT = (("none", {}), ("commfuse", {"topology": "ring"}), ("commfuse", {"splits": 2}),
               ("auto", {}))
BATCH, SEQ = 2, 15  # 15 tokens: uneven sequence shards on 2 and 4 ranks


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _step(pmodel, tokens, targets, **backward):
    local = pmodel.loss(tokens, targets)
    local.backward(**backward)
    pmodel.sync_grads()
    return pmodel.global_loss(local)


def _model_cases(rank: int, world: int) -> dict[str, list[str]]:
    torch.manual_seed(0)
    cfg = LlamaConfig(**CFGS[world])
    ref = Llama(cfg)
    model0 = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(cfg.vocab_size, (BATCH, SEQ), generator=g)
    loss_ref = ref.loss(tokens, targets)
    loss_ref.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}
    mesh = ParallelDims(tp=world).build_mesh()
    out = {}
    for method, opts, qs in [(*c, None) for c in METHODS] + [(*c, True) for c in QUERY_SPLIT]:
        runs = {}
        for depth in (1, 0):
            dims = ParallelDims(tp=world, method=method, method_opts=dict(opts),
                                regather_prefetch=depth, query_split=qs)
            pmodel = parallelize(copy.deepcopy(model0), dataclasses.replace(mesh, dims=dims))
            loss = _step(pmodel, tokens, targets)
            posts = pmodel.prefetch.posts if pmodel.prefetch else 0
            left = len(pmodel.prefetch.inflight) if pmodel.prefetch else 0
            runs[depth] = (loss, pmodel(tokens).detach(), pmodel.gather_full_grads(), posts, left)
        problems = []
        (l1, y1, g1, posts, left), (l0, y0, g0, _, _) = runs[1], runs[0]
        if posts != 2 * cfg.n_layers or left:
            problems.append(f"{posts} gathers posted ahead, {left} left in flight")
        if l1 != l0 or not torch.equal(y1, y0):
            problems.append(f"loss/logits differ with prefetch: {l1} vs {l0}")
        problems += [f"grad {n} not bit-identical" for n in g0 if not torch.equal(g1[n], g0[n])]
        if abs(l1 - loss_ref.item()) > 1e-5 * abs(loss_ref.item()):
            problems.append(f"loss {l1} vs reference {loss_ref.item()}")
        problems += [f"grad {n} rel {_rel(g1[n], grads_ref[n]):.1e}" for n in grads_ref
                     if _rel(g1[n], grads_ref[n]) > 1e-5]
        out[f"{method}-{opts}{'-qs' if qs else ''}"] = problems
    out["unconsumed"] = _unconsumed(mesh, model0, tokens, targets)
    out["ops"] = _ops_unconsumed(mesh.seq_group)
    return out


def _unconsumed(mesh, model0, tokens, targets) -> list[str]:
    """Backward cut off by ``inputs=`` (out-proj's backward posts q|k|v's gather, whose
    backward never runs), then full steps: equal to a model that never saw the cut one."""
    dims = ParallelDims(tp=mesh.dims.tp, method="commfuse")
    mesh = dataclasses.replace(mesh, dims=dims)
    cut, fresh = parallelize(copy.deepcopy(model0), mesh), parallelize(copy.deepcopy(model0), mesh)
    last = cut.model.layers[-1].attn
    local = cut.loss(tokens, targets)
    local.backward(inputs=list(last.wo.parameters()))
    problems = []
    if len(cut.prefetch.inflight) != 1:
        problems.append(f"{len(cut.prefetch.inflight)} gathers in flight after the cut backward")
    cut.zero_grad(set_to_none=True)
    for _ in range(2):  # the next forward waits it out; then two full steps match
        a, b = _step(cut, tokens, targets), _step(fresh, tokens, targets)
        ga, gb = cut.gather_full_grads(), fresh.gather_full_grads()
        if a != b or any(not torch.equal(ga[n], gb[n]) for n in gb):
            problems.append(f"step after an unconsumed prefetch differs: {a} vs {b}")
        cut.zero_grad(set_to_none=True)
        fresh.zero_grad(set_to_none=True)
    return problems


def _ops_unconsumed(group) -> list[str]:
    """The ops themselves: a retained graph run twice (the second backward gathers as usual),
    a backward that only wants the RS weight (the AG's gather posted, never taken), depth 1
    with a second post while one is in flight; afterwards plain calls still match."""
    w, r = group.size(), group.rank()
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(w * 3, 2, 8, generator=g)
    b1, b2 = torch.randn(8, 4 * w, generator=g), torch.randn(4 * w, 8, generator=g)
    x = x_all[r * 3:(r + 1) * 3]
    pre = Prefetcher(1)
    problems = []

    def pair(b1_, b2_, prefetch):
        _, (y,) = fused_all_gather_matmul(x, [b1_[:, r * 4:(r + 1) * 4]], 0, group,
                                          return_A=False, prefetch=prefetch)
        return fused_matmul_reduce_scatter(y, b2_[r * 4:(r + 1) * 4], "sum", 0, group,
                                           prefetch=prefetch)

    def grads(prefetch, **kw):
        p1, p2 = b1.clone().requires_grad_(), b2.clone().requires_grad_()
        out = pair(p1, p2, prefetch)
        out.square().sum().backward(**kw)
        return out.detach(), p1.grad, p2.grad

    want = grads(None)
    p1, p2 = b1.clone().requires_grad_(), b2.clone().requires_grad_()
    out = pair(p1, p2, pre)
    out.square().sum().backward(retain_graph=True)
    first = (p1.grad.clone(), p2.grad.clone())
    out.square().sum().backward()  # the ticket is spent: the second backward gathers itself
    if not (torch.equal(first[0], want[1]) and torch.equal(p1.grad, 2 * want[1])):
        problems.append("retained graph: dB1 differs")
    out2 = pair(b1.clone().requires_grad_(), (q2 := b2.clone().requires_grad_()), pre)
    out2.square().sum().backward(inputs=[q2])  # posts the AG's gather; its backward never runs
    if len(pre.inflight) != 1 or not torch.equal(q2.grad, want[2]):
        problems.append(f"cut backward: {len(pre.inflight)} in flight, dB2 equal "
                        f"{torch.equal(q2.grad, want[2])}")
    got = grads(pre)  # depth 1: its post waits out the abandoned one first
    if pre.inflight or any(not torch.equal(a, b) for a, b in zip(got, want)):
        problems.append("after an abandoned gather: results differ or something in flight")
    pre.drain()
    return problems


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_model_cases, world, timeout=600, pg_timeout_s=60)


CASES = [f"{m}-{o}" for m, o in METHODS] + [f"{m}-{o}-qs" for m, o in QUERY_SPLIT] + [
    "unconsumed", "ops"]


@pytest.mark.parametrize("world", (2, 3, 4))
@pytest.mark.parametrize("case", CASES)
def test_prefetch_on_2_3_4_ranks(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems

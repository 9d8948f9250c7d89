"""commfuse.infer's interleaved prefill (`commfuse.infer.interleave`) and `auto`'s measured
choice of prefill plan (`commfuse.infer.plans`): the chunked prefill against one process,
a missing peer, the prediction on its limits, and the tuner on a group. Exactness across
methods and ranks is in test_infer.py (its variants include the chunk counts)."""

import pytest
import torch

from commfuse.infer import InferenceLlama, generate, pad_prompts
from commfuse.models.llama import LlamaConfig
from commfuse.testbed.spawn import run_local
from test_infer import NEW, PROMPTS, model


def test_interleaved_prefill_in_one_process():
    """The chunked prefill without a group (every collective the identity) gives the
    unchunked logits and cache, for every chunk count up to one position per chunk (and
    more chunks than positions)."""
    m = model()
    ref = InferenceLlama(m)
    for prompts in PROMPTS:
        tokens, lengths = pad_prompts(prompts)
        want_cache = ref.new_cache(len(prompts), tokens.shape[1])
        want = ref.prefill(tokens, lengths, want_cache)
        for chunks in (2, 3, 5, tokens.shape[1], tokens.shape[1] + 4):
            tp = InferenceLlama(m, prefill_chunks=chunks)
            cache = tp.new_cache(len(prompts), tokens.shape[1])
            got = tp.prefill(tokens, lengths, cache)
            assert (got - want).abs().max() < 1e-12, (len(prompts), chunks)
            for a, b in zip(cache.k + cache.v, want_cache.k + want_cache.v):
                assert (a - b).abs().max() < 1e-12
            assert torch.equal(cache.lengths_B, want_cache.lengths_B)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunks"):
            InferenceLlama(m, prefill_chunks=bad)


def _interleaved_timeout_rank(rank, world):
    """A peer that never joins the interleaved prefill: the waiting rank fails within its
    timeout, naming the chunk and collective, instead of hanging."""
    import time

    import torch.distributed as dist

    from commfuse.errors import CommFuseError

    if rank == 1:
        time.sleep(8)
        return "absent"
    tp = InferenceLlama(model(), dist.group.WORLD, "none", prefill_chunks=2, timeout=2)
    tokens, lengths = pad_prompts(PROMPTS[2])
    t0 = time.monotonic()
    try:
        tp.prefill(tokens, lengths, tp.new_cache(1, tokens.shape[1]))
    except CommFuseError as e:
        return (str(e), time.monotonic() - t0)
    return "no error"


def test_interleaved_prefill_times_out_naming_the_chunk():
    results = run_local(_interleaved_timeout_rank, 2, timeout=120, pg_timeout_s=30)
    message, took = results[0]
    assert "interleaved prefill, rank 0 of 2: chunk 0's all-reduce" in message, message
    assert took < 6, took


def test_interleaved_prefill_prediction():
    """`interleaved_prefill_s` on its limits: no link time leaves the compute alone (the same
    for any chunk count, and on 2 ranks none's with the norms of every row), no compute
    leaves the transfers back to back (on 2 ranks an all-reduce of each chunk's partials
    moves the bytes of its reduce-scatter and all-gather); and `prefill_choice`
    picks the fused ops on one rank or with nothing to hide, and chunks where the transfers
    are twice the compute."""
    import dataclasses

    from commfuse.infer import predict
    from commfuse.sim.hardware import preset
    from commfuse.sim.step.work import block_width_bytes, mem_time

    cfg = LlamaConfig.preset("small")
    hw = preset("cpu-testbed")
    fast_link = dataclasses.replace(hw, link_bandwidth=1e18, link_latency=0.0)
    compute = [predict.interleaved_prefill_s(cfg, 2, 2048, n, fast_link) for n in (2, 4)]
    assert compute[0] == pytest.approx(compute[1], rel=0.05)
    # on 2 ranks replicated: none's compute and the norms and residual adds of the other half
    redundant = cfg.n_layers * mem_time(hw, block_width_bytes(cfg, 4) * 1024)
    assert compute[0] == pytest.approx(predict.prefill_s(cfg, 2, "none", 2048, fast_link)
                                       + redundant, rel=0.05)
    free = dataclasses.replace(hw, gemm_flops=1e30, mem_bandwidth=1e30,
                               attention_efficiency=(0.0, 0.0), host_collective_s=0.0)
    moves = 2 * cfg.n_layers * 2 * hw.collective_time("all_gather", 2 * 1024 * cfg.dim * 4, 2)
    sp = 2 * cfg.n_layers * 4 * hw.collective_time("all_gather", 1024 * cfg.dim * 4, 2)
    assert moves == pytest.approx(sp, rel=0.01)  # the same bytes, half the latencies
    assert predict.interleaved_prefill_s(cfg, 2, 2048, 2, free) == pytest.approx(moves,
                                                                                  rel=1e-3)
    sp4 = 2 * cfg.n_layers * 4 * hw.collective_time("all_gather", 1024 * cfg.dim * 4, 4)
    assert predict.interleaved_prefill_s(cfg, 4, 2048, 2, free) == pytest.approx(sp4, rel=1e-3)
    both = predict.interleaved_prefill_s(cfg, 2, 2048, 4, hw)
    assert max(compute[1], moves) < both < compute[1] + moves
    assert predict.prefill_choice(cfg, 1, 2048, 1, hw, 4) == 1
    assert predict.best_chunks(cfg, 2, 3, 1, hw, 4) == (1, float("inf"))  # no rows to cut
    assert predict.prefill_choice(cfg, 2, 2048, 1, fast_link, 4) == 1  # nothing to hide
    slow_link = dataclasses.replace(hw, link_bandwidth=hw.link_bandwidth / 4)
    n = predict.prefill_choice(cfg, 2, 2048, 1, slow_link, 4)  # transfers 2x the compute
    assert n in predict.CHUNK_CANDIDATES
    assert predict.best_chunks(cfg, 2, 2048, 1, slow_link, 4) == (
        n, predict.interleaved_prefill_s(cfg, 2, 2048, n, slow_link))


def test_plan_tuner():
    """Warm-up first (the model's pick, untimed), then each plan once, timed, then the
    faster for good; one plan: never timed; buckets by power of two and batch."""
    from commfuse.infer.plans import PlanTuner

    t = PlanTuner()
    key = PlanTuner.bucket(1500, 2)
    assert key == (2048, 2) and PlanTuner.bucket(2048, 2) == key
    assert PlanTuner.bucket(2049, 2) == (4096, 2) and PlanTuner.bucket(1, 1) == (1, 1)
    plans = ["fused", "interleaved"]
    assert t.next(key, plans) == ("fused", False)
    assert t.decided(key, plans) is None
    assert t.next(key, plans) == ("fused", True)
    t.record(key, "fused", 2.0)
    assert t.next(key, plans) == ("interleaved", True)
    t.record(key, "interleaved", 1.5)
    assert t.decided(key, plans) == "interleaved"
    assert [t.next(key, plans) for _ in range(3)] == [("interleaved", False)] * 3
    assert t.next((8, 1), ["fused"]) == ("fused", False)
    assert t.next((8, 1), ["fused"]) == ("fused", False)


def _tuned_rank(rank, world):
    """auto's measured plan choice on a group: the prefills of one shape run warm-up, both
    plans timed, then the faster, the same on every rank, each with the single process's
    tokens; runs_chunks reports the winner."""
    import torch.distributed as dist

    from commfuse.infer.plans import PlanTuner

    m = model()
    ref = InferenceLlama(m)
    prompts = PROMPTS[2]
    want = generate(ref, prompts, NEW)
    from commfuse.infer import interleave, plans

    tp = InferenceLlama(m, dist.group.WORLD, "auto", timeout=60)
    ran = []
    real = interleave.prefill
    interleave.prefill = lambda *a, **k: ran.append(len(ran)) or real(*a, **k)
    try:
        same = []
        for _ in range(5):
            before = len(ran)
            same.append((generate(tp, prompts, NEW) == want, len(ran) > before))
    finally:
        interleave.prefill = real
    S, w = len(prompts[0]), m.tok_emb.weight
    key = PlanTuner.bucket(S, 1)
    return (same, dict(tp.tuner.buckets[key]["times"]), plans.auto_plans(tp, S, 1, w),
            plans.runs_chunks(tp, "auto", S, 1, w))


def test_auto_prefill_plan_is_measured():
    results = run_local(_tuned_rank, 2, timeout=300, pg_timeout_s=60)
    (same, times, plans, chunks), other = results[0], results[1]
    assert other[1] == times  # the slowest rank's times: every rank decides alike
    assert all(ok for ok, _ in same)
    labels = [p for p, _ in plans]
    assert sorted(times) == sorted(labels) == ["fused", "interleaved"]
    winner = min(labels, key=lambda p: times[p])
    interleaved = [ran for _, ran in same]
    # warm-up on the model's pick, then each plan in the model's order, then the winner
    order = [labels[0], labels[0], labels[1], winner, winner]
    assert interleaved == [p == "interleaved" for p in order], (interleaved, labels, times)
    assert chunks == dict(plans)[winner]

"""commfuse.infer: the KV cache against full forwards, TP generation against one process (every
method, 2/3/4 gloo ranks), sampling, checkpoints read back whole; `commfuse generate` itself
in test_infer_cli.py."""

import pytest
import torch

from commfuse.infer import InferenceLlama, Sampling, generate, pad_prompts, sample
from commfuse.models.llama import Llama, LlamaConfig
from commfuse.testbed.spawn import run_local

# 12 heads and FFN 192 divide by 2, 3 and 4; GQA (6 kv heads) on 2 and 3 ranks
CFG = dict(vocab_size=256, dim=96, n_layers=2, n_heads=12, n_kv_heads=12, ffn_hidden=192,
           max_seq_len=64)
METHODS = [("none", {}), ("sliced", {"chunks": 2}), ("decompose", {}), ("commfuse", {}),
           ("commfuse", {"topology": "direct", "splits": 2}), ("auto", {})]
# (method, opts, query_split, decode_method): decode on the fused ops with each method, and
# replicated with all-reduces ("auto" picks one of the two by the cost model)
VARIANTS = ([(m, o, False, None) for m, o in METHODS]
            + [("commfuse", {}, True, None), ("commfuse", {}, False, "allreduce"),
               ("auto", {}, True, "auto")])
# lengths 7 and 5 divide by none of 2, 3, 4; a prompt of one token, alone and in a batch
PROMPTS = [[[3, 17, 99, 5, 250, 8, 41], [200], [9, 9, 1, 77, 130]], [[42]], [list(range(1, 23))]]
NEW = 6


def model(dtype=torch.float64, **over) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**CFG, **over})).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kv", [12, 4])
def test_cache_logits_equal_full_forward(dtype, tol, kv):
    """Prefill of a padded batch and every decode step: the logits of each sequence's next
    token equal the full forward of that sequence alone (no cache, no padding)."""
    m = model(dtype, n_kv_heads=kv)
    inf = InferenceLlama(m)
    prompts = PROMPTS[0]
    tokens, lengths = pad_prompts(prompts)
    cache = inf.new_cache(len(prompts), tokens.shape[1] + NEW)
    logits = inf.prefill(tokens, lengths, cache)
    seqs = [list(p) for p in prompts]
    for step in range(NEW):
        for b, s in enumerate(seqs):
            ref = m(torch.tensor([s]))[0, -1]
            err = (logits[b] - ref).abs().max() / ref.abs().max()
            assert err < tol, (step, b, err.item())
        nxt = logits.argmax(-1)
        for b, s in enumerate(seqs):
            s.append(int(nxt[b]))
        logits = inf.decode(nxt, cache)
    assert cache.lengths_B.tolist() == [len(p) + NEW for p in prompts]


def test_cache_errors():
    inf = InferenceLlama(model())
    cache = inf.new_cache(1, 4)
    with pytest.raises(ValueError, match="do not fit"):
        inf.prefill(torch.zeros(1, 5, dtype=torch.long), torch.tensor([5]), cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        inf.new_cache(1, 65)
    inf.prefill(torch.zeros(1, 4, dtype=torch.long), torch.tensor([4]), cache)
    with pytest.raises(ValueError, match="empty cache"):
        inf.prefill(torch.zeros(1, 4, dtype=torch.long), torch.tensor([4]), cache)
    with pytest.raises(ValueError, match="full"):
        inf.decode(torch.zeros(1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="at least one token"):
        pad_prompts([[1], []])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(inf, [[1]], 0)


def test_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, Sampling(), None), greedy)
    assert torch.equal(sample(logits, Sampling(1.0, top_k=1), g), greedy)
    assert torch.equal(sample(logits, Sampling(1.0, top_p=1e-6), g), greedy)
    draw = lambda how: sample(logits, how, torch.Generator().manual_seed(how.seed))
    how = Sampling(0.8, top_k=5, top_p=0.9, seed=3)
    assert torch.equal(draw(how), draw(how))  # seeded: the same on every rank
    top5 = logits.topk(5, -1).indices
    for _ in range(20):
        pick = sample(logits, Sampling(1.0, top_k=5), g)
        assert all(int(p) in top5[b].tolist() for b, p in enumerate(pick))
    # top-p keeps the smallest set of tokens whose probability reaches p
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    seen = {int(sample(probs, Sampling(1.0, top_p=0.75), g)) for _ in range(200)}
    assert seen == {0, 1}
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)


# Sampling draws from the gathered logits with one seed on every rank, the same code for every
# method: greedy decoding checks each variant's tokens on every prompt set; sampled decoding
# the plain, a fused and the auto-decode variant, and one interleaved prefill, on the first
SAMPLED = [v for v in VARIANTS if v in (("none", {}, False, None), ("commfuse", {}, False, None),
                                        ("auto", {}, True, "auto"))]


def _tp_rank(rank, world):
    """Every method (and query-split) on this group: greedy and sampled tokens and the first
    logits against the single process."""
    import torch.distributed as dist

    kvs = [12, 6] if 6 % world == 0 else [12]
    failures = []
    for kv in kvs:
        m = model(n_kv_heads=kv)
        ref = InferenceLlama(m)
        for how in (Sampling(), Sampling(0.9, top_k=20, top_p=0.9, seed=5)):
            greedy = how.temperature == 0
            for prompts in PROMPTS if greedy else PROMPTS[:1]:
                want = generate(ref, prompts, NEW, how)
                for method, opts, qs, dec in VARIANTS if greedy else SAMPLED:
                    tp = InferenceLlama(m, dist.group.WORLD, method, qs, dec, timeout=60, **opts)
                    got = generate(tp, prompts, NEW, how)
                    if got != want:
                        failures.append((kv, how.temperature, len(prompts), method, opts, qs,
                                         dec, got, want))
                for chunks in (2, 3) if greedy else (2,):  # interleaved prefill, fused decode
                    tp = InferenceLlama(m, dist.group.WORLD, "none", prefill_chunks=chunks,
                                        timeout=60)
                    got = generate(tp, prompts, NEW, how)
                    if got != want:
                        failures.append((kv, how.temperature, len(prompts), "chunks", chunks,
                                         got, want))
        tokens, lengths = pad_prompts(PROMPTS[0])
        a = ref.prefill(tokens, lengths, ref.new_cache(3, 8))
        tp = InferenceLlama(m, dist.group.WORLD, "commfuse")
        b = tp.prefill(tokens, lengths, tp.new_cache(3, 8))
        if (a - b).abs().max() > 1e-12:
            failures.append((kv, "logits", (a - b).abs().max().item()))
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tp_generation_equals_single_process(world):
    results = run_local(_tp_rank, world, timeout=900, pg_timeout_s=120)
    assert results == [[]] * world, results[0][:3]


def _prefill_gemm_rank(rank, world):
    """Prefill (B = 1 and a padded batch of 3) with every method: the logits of the single
    process, and no batched GEMM dispatched (`commfuse.runtime.modes.gemm`: the ops' GEMMs on
    moved, size-1 batch dims once ran as one GEMM per row, 3-4x slower)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func).split(".")[1])
            return func(*args, **(kwargs or {}))

    m = model()
    ref = InferenceLlama(m)
    failures = []
    for prompts in (PROMPTS[2], PROMPTS[0]):
        tokens, lengths = pad_prompts(prompts)
        want = ref.prefill(tokens, lengths, ref.new_cache(len(prompts), tokens.shape[1]))
        for method, opts in METHODS + [("none", {"prefill_chunks": n}) for n in (2, 3, 4, 30)]:
            tp = InferenceLlama(m, dist.group.WORLD, method, timeout=60, **opts)
            with AtenLog() as log:
                got = tp.prefill(tokens, lengths, tp.new_cache(len(prompts), tokens.shape[1]))
            err = (got - want).abs().max().item()
            if err > 1e-12 or "bmm" in log.ops or "mm" not in log.ops:
                failures.append((len(prompts), method, opts, err, sorted(log.ops)))
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_prefill_exact_with_no_batched_gemm(world):
    results = run_local(_prefill_gemm_rank, world, timeout=600, pg_timeout_s=120)
    assert results == [[]] * world, results[0][:2]


def test_divisibility_is_checked():
    class G:
        def size(self):
            return 5

        def rank(self):
            return 0

    with pytest.raises(ValueError, match="n_heads"):
        InferenceLlama(model(), G())


def _save_rank(rank, world, tp, up, dp, root):
    from commfuse.parallel.checkpoint import save_checkpoint
    from commfuse.parallel.config import ParallelDims
    from commfuse.parallel.plan import parallelize

    torch.manual_seed(0)
    cfg = LlamaConfig.preset("tiny", n_kv_heads=2, tie_embeddings=tp == 2 and dp == 2)
    pmodel = parallelize(Llama(cfg), ParallelDims(tp, up, dp, "none", world_size=world))
    opt = torch.optim.AdamW(pmodel.parameters())
    meta = {"tp": tp, "up": up, "dp": dp, "world": world, "preset": "tiny",
            "model": {"n_kv_heads": 2, "tie_embeddings": tp == 2 and dp == 2},
            "dtype": "float32"}
    save_checkpoint(pmodel, opt, root, 3, meta)
    return True


@pytest.mark.parametrize("tp,up,dp", [(2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2)])
def test_checkpoint_read_back_whole(tmp_path, tp, up, dp):
    from commfuse.infer.load import load_llama

    run_local(_save_rank, tp * up * dp, tp, up, dp, str(tmp_path), timeout=300)
    got, meta = load_llama(tmp_path)
    torch.manual_seed(0)
    want = Llama(LlamaConfig.preset("tiny", n_kv_heads=2, tie_embeddings=tp == 2 and dp == 2))
    assert meta["tp"] == tp
    ref = want.state_dict()
    for name, t in got.state_dict().items():
        assert torch.equal(t, ref[name]), name
    assert (got.output.weight is got.tok_emb.weight) == (tp == 2 and dp == 2)


def _auto_query_split_rank(rank, world):
    """Method auto on a hardware model where query-split attention wins (the SLOW of
    test_query_split_choice), its prefill chunks forced to 1 and then the cost model's: each
    prefill runs query-split iff `choose_query_split` says so (and no chunks are chosen), and
    interleaved iff `prefill_choice` picks chunks; the tokens are the single process's.
    (chunks forced, ran query-split, predicted, ran interleaved, predicted, tokens equal) per
    prompt set."""
    import torch.distributed as dist

    from commfuse.infer import interleave
    from commfuse.infer import model as infer_model
    from commfuse.infer.predict import prefill_choice
    from commfuse.ops import auto
    from test_query_split_choice import SLOW

    auto.set_hardware(SLOW)
    m = model()
    ref = InferenceLlama(m)
    ran, chunked = [], []
    real, real_chunked = infer_model.query_split_attention, interleave.prefill
    infer_model.query_split_attention = lambda *a, **k: ran.append(True) or real(*a, **k)
    interleave.prefill = lambda *a, **k: chunked.append(a[-1]) or real_chunked(*a, **k)
    out = []
    try:
        for forced in (1, None):
            for prompts in PROMPTS:
                ran.clear(), chunked.clear()
                tp = InferenceLlama(m, dist.group.WORLD, "auto", timeout=60,
                                    prefill_chunks=forced)
                got = generate(tp, prompts, NEW)
                S, B, c = max(len(p) for p in prompts), len(prompts), m.cfg
                qs = auto.choose_query_split(S, B, c.n_heads, c.n_kv_heads, c.head_dim,
                                             c.dim, world, m.tok_emb.weight, backward=False)
                n = forced or prefill_choice(c, world, S, B, SLOW, 8, qs)
                out.append((forced, bool(ran), qs and n == 1, chunked[0] if chunked else 1,
                            n, got == generate(ref, prompts, NEW)))
    finally:
        infer_model.query_split_attention = real
        interleave.prefill = real_chunked
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_auto_prefill_runs_query_split_where_the_model_predicts_it(world):
    results = run_local(_auto_query_split_rank, world, timeout=600, pg_timeout_s=120)
    for rank, rows in enumerate(results):
        assert all(qs == want_qs and n == want_n and same
                   for _, qs, want_qs, n, want_n, same in rows), (rank, rows)
    if world == 2:  # the model picks each for some prompts here: the test is not vacuous
        assert [qs for _, qs, *_ in results[0]] == [True, False, True] + [False] * 3
        chunks = [n for _, _, _, n, *_ in results[0]][3:]  # a 1-token prompt is not cut
        assert chunks[1] == 1 and min(chunks[0], chunks[2]) > 1, chunks

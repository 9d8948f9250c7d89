"""Parallel plans (TP, UP, DP and their combinations) against the unsharded Llama.

One spawn per world size runs every layout x method: each rank rebuilds the reference model
from the seed, computes its loss, logits and gradients in one process, then parallelizes a
copy and compares its logits (its batch rows; with TP/UP its vocabulary slice of the whole
sequence), the global loss, every full
gradient (`gather_full_grads`) and, for DP, each rank's gradient shard as the fused backward
left it (no collective after backward touches sharded weights).
"""

import copy
import dataclasses
import functools

import pytest
import torch

from commfuse.models.llama import Llama, LlamaConfig
from commfuse.parallel import ParallelDims, parallelize
from commfuse.parallel.data import ShardedLinear
from commfuse.parallel.ulysses import permute_qkv, unpermute_qkv
from commfuse.testbed.spawn import run_local

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
           max_seq_len=16)
BATCH, SEQ = 12, 16  # divisible by every dp
METHODS = (("none", {}), ("sliced", {"chunks": 2}), ("decompose", {"topology": "ring"}),
           ("commfuse", {"topology": "ring"}), ("commfuse", {"topology": "direct"}),
           ("auto", {}))  # auto: under DP only (the ZeRO-3 prefetch's backward resolves it)
# query_split=True: the model runs on the balanced order of the sequence (`SeqLayout`)
LAYOUTS = {2: [dict(tp=2), dict(tp=2, query_split=True), dict(up=2), dict(dp=2)],
           3: [dict(tp=3), dict(tp=3, query_split=True), dict(dp=3)],
           4: [dict(tp=2, dp=2), dict(up=2, dp=2), dict(tp=4), dict(tp=4, query_split=True),
               dict(tp=2, dp=2, query_split=True), dict(dp=4)]}
# variant: (LlamaConfig overrides, dtype of the parallel model, norm-relative tolerance vs the
# float32 reference); float32 runs every method, the others commfuse (ring) only
VARIANTS = {"f32": ({}, torch.float32, 1e-5), "bf16": ({}, torch.bfloat16, 3e-2),
            "tied": ({"tie_embeddings": True}, torch.float32, 1e-5),
            "seq15": ({}, torch.float32, 1e-5),  # 15 tokens: uneven sequence shards
            "kv4": ({"n_kv_heads": 4}, torch.float32, 1e-5),  # for tp=4
            "tp3": ({"dim": 48, "n_heads": 6, "n_kv_heads": 3, "ffn_hidden": 96, "vocab_size": 66},
                    torch.float32, 1e-5),
            # 33 head rows per TP rank: not divisible by dp=2, the head stays replicated over DP
            "v66": ({"vocab_size": 66}, torch.float32, 1e-5),
            # ZeRO-3 prefetch (on, one block ahead, in every other variant): off; two blocks
            # ahead; a byte limit that leaves only the current block's gathers posted
            "pf0": ({}, torch.float32, 1e-5), "pf2": ({}, torch.float32, 1e-5),
            "pf0mb": ({}, torch.float32, 1e-5)}
SEQ_OF = {"seq15": 15}
DIMS_OF = {"pf0": {"prefetch": 0}, "pf2": {"prefetch": 2}, "pf0mb": {"prefetch_mb": 0.0}}
ONLY = {"kv4": [dict(tp=4), dict(tp=4, query_split=True)],  # where these run
        "tp3": [dict(tp=3), dict(tp=3, query_split=True), dict(dp=3)],
        "v66": [dict(tp=2, dp=2)], **{v: [dict(dp=2), dict(dp=4), dict(tp=2, dp=2)]
                                       for v in DIMS_OF}}
# the others, the ZeRO-3 prefetch depths among them: commfuse only
EVERY_METHOD = ("f32", "seq15", "kv4", "tp3", "v66")


def _fits_cfg(layout: dict) -> bool:
    """Whether the default CFG splits over ``layout`` (tp=3 / tp=4 need their own shapes)."""
    try:
        ParallelDims(**layout, world_size=functools.reduce(int.__mul__, (
            layout.get(a, 1) for a in ("tp", "up", "dp")))).check_model(LlamaConfig(**CFG))
    except ValueError:
        return False
    return True


def _cases(world: int) -> list[tuple[dict, str, dict, str]]:
    out = []
    for lay in LAYOUTS[world]:
        own = [v for v, only in ONLY.items() if lay in only]
        # seq15's uneven shards are sequence shards: pure DP splits the batch, not the sequence
        seq = [v for v in SEQ_OF if "tp" not in lay and "up" not in lay]
        for v in [v for v in VARIANTS if v not in ONLY and v not in seq and _fits_cfg(lay)] + own:
            out += [(lay, m, o, v) for m, o in METHODS
                    if (v in EVERY_METHOD and (m != "auto" or "dp" in lay))
                    or (m, o) == ("commfuse", {"topology": "ring"})]
    return out


def _case_id(layout: dict, method: str, opts: dict, variant: str) -> str:
    axes = "x".join(f"{k}{v}" for k, v in layout.items())
    return f"{axes}-{method}" + "".join(f"-{v}" for v in opts.values()) + f"-{variant}"


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@functools.lru_cache(maxsize=None)
def _reference(variant: str):
    """(untouched model, tokens, targets, logits, loss, grads) of the unsharded float32 model."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**CFG, **VARIANTS[variant][0]})
    ref = Llama(cfg)
    model0 = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    seq = SEQ_OF.get(variant, SEQ)
    tokens = torch.randint(cfg.vocab_size, (BATCH, seq), generator=g)
    targets = torch.randint(cfg.vocab_size, (BATCH, seq), generator=g)
    targets[0, 3] = -100  # an ignored target: the loss must count tokens globally
    logits = ref(tokens).detach()
    loss = ref.loss(tokens, targets)
    loss.backward()
    return model0, tokens, targets, logits, loss.item(), {n: p.grad for n, p in
                                                          ref.named_parameters()}


def _check(mesh, method, opts, variant) -> list[str]:
    model0, tokens, targets, logits_ref, loss_ref, grads_ref = _reference(variant)
    _, dtype, tol = VARIANTS[variant]
    b = BATCH // mesh.dims.dp
    rows = slice(mesh.dp_index * b, (mesh.dp_index + 1) * b)
    dims = dataclasses.replace(mesh.dims, method=method, method_opts=dict(opts),
                               **DIMS_OF.get(variant, {}))
    pmodel = parallelize(copy.deepcopy(model0).to(dtype), dataclasses.replace(mesh, dims=dims))
    problems = []
    local = pmodel.loss(tokens[rows], targets[rows])
    local.backward()
    pmodel.sync_grads()
    pf = pmodel.prefetcher
    if (pf is not None) != (mesh.dims.dp > 1 and dims.prefetch > 0):
        problems.append(f"prefetcher {pf} with dp={mesh.dims.dp} prefetch={dims.prefetch}")
    elif pf is not None:  # it ran, within its bound, and left nothing posted
        ahead = 0 if dims.prefetch_mb == 0 else dims.prefetch
        bound = (ahead + 1) * max(len(u) for u in pf.units)
        if not 0 < pf.peak_pending <= bound or any(pf.pending.values()):
            problems.append(f"prefetch: peak {pf.peak_pending} posted (bound {bound}), "
                            f"left {[len(p) for p in pf.pending.values()]}")
    # of the loss's forward, the one that ran the backward: balanced iff query-split ran
    order, qs = pmodel.layout.order, pmodel.layout.query_split
    if order != ("balanced" if qs else "contiguous") or (mesh.dims.query_split and not qs):
        problems.append(f"the sequence ran in the {order} order, query-split {qs}")
    logits, want = pmodel(tokens[rows]).detach(), logits_ref[rows][..., pmodel.vocab_slice()]
    if _rel(logits, want) > tol:
        problems.append(f"logits rel {_rel(logits, want):.2e}")
    loss = pmodel.global_loss(local)
    if abs(loss - loss_ref) > tol * abs(loss_ref):
        problems.append(f"loss {loss} vs {loss_ref}")
    if mesh.dims.seq == 1:  # pure DP: every shard as the fused backward left it
        for name, mod in pmodel.model.named_modules():
            if isinstance(mod, ShardedLinear):
                o = mod.weight.shape[0]
                err = _rel(mod.weight.grad, grads_ref[f"{name}.weight"][mesh.dp_index * o:][:o])
                if err > tol:
                    problems.append(f"shard grad {name} rel {err:.2e}")
    full = pmodel.gather_full_grads()
    if set(full) != set(grads_ref):
        problems.append(f"grad names differ: {set(full) ^ set(grads_ref)}")
    for name in sorted(set(full) & set(grads_ref)):
        if full[name].shape != grads_ref[name].shape:
            problems.append(f"grad {name} shape {tuple(full[name].shape)}")
        elif _rel(full[name], grads_ref[name]) > tol:
            problems.append(f"grad {name} rel {_rel(full[name], grads_ref[name]):.2e}")
    return problems


def _run_cases(rank: int, world: int) -> dict[str, list[str]]:
    results, meshes = {}, {}
    for layout, method, opts, variant in _cases(world):
        key = tuple(layout.items())
        if key not in meshes:  # groups are built once per layout, on every rank in one order
            meshes[key] = ParallelDims(**layout).build_mesh()
        results[_case_id(layout, method, opts, variant)] = _check(meshes[key], method, opts,
                                                                 variant)
    return results


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run_cases, world, timeout=300, pg_timeout_s=60)


CASES = [(w, _case_id(*c)) for w in LAYOUTS for c in _cases(w)]


@pytest.mark.parametrize("world,case", CASES, ids=[c for _, c in CASES])
def test_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


# --- no processes: config validation and the Ulysses weight permutation ---------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(tp=2, world_size=4), "must equal the world size"),
    (dict(tp=2, up=2, world_size=4), "not supported"),
    (dict(tp=0, world_size=1), "positive int"),
    (dict(dp=2, method="fast", world_size=2), "method must be one of"),
    (dict(dp=2, method="sliced", method_opts={"topology": "ring"}, world_size=2), "unknown option"),
    (dict(dp=2, method_opts={"topology": "star"}, world_size=2), "topology"),
    (dict(up=2, query_split=True, world_size=2), "query_split=True needs tp"),
])
def test_dims_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_dims_defaults_to_product_and_builds_kwargs():
    dims = ParallelDims(tp=2, dp=3, method="sliced", method_opts={"chunks": 2})
    assert dims.world_size == 6 and dims.seq == 2
    assert dims.op_kwargs == {"method": "sliced", "chunks": 2}


@pytest.mark.parametrize("dims,cfg,kw,match", [
    (dict(tp=4), dict(n_heads=4, n_kv_heads=2), {}, r"n_kv_heads \(2\) must be divisible by 4"),
    (dict(tp=3), dict(n_heads=4), {}, r"n_heads \(4\)"),
    (dict(dp=2), dict(), dict(batch_size=3), r"global batch size \(3\)"),
    (dict(dp=3), dict(n_heads=4, dim=32), {}, r"rows of wq \(32\)"),
    (dict(tp=2, dp=16), dict(n_heads=4, n_kv_heads=2, dim=32), {},
     r"rows of wk/wv \(per TP rank\) \(8\)"),
    (dict(dp=2), dict(), dict(seq_len=4096), "exceeds max_seq_len"),
    (dict(up=2), dict(vocab_size=63), {}, r"vocab_size \(63\) must be divisible by 2"),
    (dict(dp=4), dict(vocab_size=66), {}, r"rows of output \(66\)"),
])
def test_check_model_rejects(dims, cfg, kw, match):
    d = ParallelDims(**dims)
    c = LlamaConfig(**{**CFG, **cfg})
    with pytest.raises(ValueError, match=match):
        d.check_model(c, **kw)


def test_qkv_permutation_round_trips_and_groups_heads():
    wq, wk, wv = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    w = permute_qkv(wq, wk, wv, 2)
    assert torch.equal(w[:8], torch.cat([wq[:4], wk[:2], wv[:2]]))  # head group 0's q|k|v
    for got, want in zip(unpermute_qkv(w, 2, 8, 4), (wq, wk, wv)):
        assert torch.equal(got, want)

"""`commfuse.tp.parallelize` on transformers' MixtralForCausalLM and Qwen3MoeForCausalLM
(TPSP attention, experts split over the same ranks) against the unsharded model, float64.

One `run_local` per world size (2, 3, 4) runs every case: each rank builds the reference
model from the seed, computes logits, loss (cross-entropy + the router's auxiliary loss) and
every gradient in one process, then parallelizes a copy and compares them all, for every
method; a starved case sets the weights so that every token picks the first rank's experts
(the other ranks and most experts receive no token) and a short sequence leaves a rank
without tokens of its own; FSDP2 over "dp" x this plan over "tp" on a 2 x 2 mesh; bad input (experts not divisible, a config with router noise,
counts that disagree between ranks) must raise on every rank without a hang.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local

ARCHS = ("mixtral", "qwen3")
METHODS = {"none": {}, "sliced": {"chunks": 2}, "commfuse": {}, "auto": {}}
# norm-relative, float64 against float64; both models' routers take the softmax in float32
# (as transformers defines them), so a routing weight carries float32 rounding of logits that
# the sharded model sums in another order: about 1e-8 of the unsharded values, not 1e-16
TOL = 1e-6
SEQ = 11  # split unevenly over 2, 3 and 4 ranks
TRAIN = {"mixtral": ("none", "commfuse", "auto"), "qwen3": ("commfuse",)}  # on 2 ranks
STEPS = 8  # the loss of each must match and fall by 0.5 over them


def build(arch: str, world: int, seed: int = 0, **extra):
    """A tiny float64 model; on 3 ranks 6 experts and 6 / 3 heads (8 / 4 otherwise)."""
    import transformers
    three = world == 3
    common = dict(vocab_size=63, hidden_size=48 if three else 32, num_hidden_layers=2,
                  num_attention_heads=6 if three else 4, num_key_value_heads=3 if three else 2,
                  max_position_embeddings=64, tie_word_embeddings=False,
                  output_router_logits=True, router_aux_loss_coef=0.5,
                  attn_implementation="sdpa", experts_implementation="eager", num_experts_per_tok=2)
    experts = 6 if three else 8
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=24,
                                         **{"num_local_experts": experts, **extra})
        cls = transformers.MixtralForCausalLM
    else:  # top-k weights not renormalised; layer 0 a dense SwiGLU MLP
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=40, moe_intermediate_size=24,
                                          num_experts=experts, head_dim=8, norm_topk_prob=False,
                                          mlp_only_layers=[0], **extra)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    return cls(cfg).double()


def starve(model, world: int) -> None:
    """Every token's top-2 among the first rank's experts: hidden dim 0 is large and positive
    in the residual stream (the embedding's column 0), and the other ranks' experts' router
    rows read it with a large negative weight."""
    E = model.config.num_experts if hasattr(model.config, "num_experts") else \
        model.config.num_local_experts
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight[E // world:, 0] = -50.0


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _full_grad(p, want_shape, world: int) -> torch.Tensor:
    """The unsharded gradient of DTensor ``p``; kv weights replicated over ranks folded back."""
    g = p.grad.full_tensor()
    if g.shape == want_shape:
        return g
    k = g.shape[0] // want_shape[0]
    return g.reshape(world // k, k, -1, *g.shape[1:])[:, 0].reshape(want_shape)


def _check_exact(arch: str, method: str, mesh, variant: str = "") -> list[str]:
    import commfuse.tp as tp
    world, rank = mesh.size(), mesh.get_local_rank()
    ref = build(arch, world)
    seq = 3 if variant == "short" else SEQ  # short: on 4 ranks the last has no tokens
    if variant == "starved":
        starve(ref, world)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(63, (2, seq), generator=g)
    labels = ids.roll(-1, 1)
    out = ref(ids, labels=labels)
    out.loss.backward()
    tp.parallelize(model, mesh, method=method, timeout=60, loss_parallel=variant == "lp",
                   **METHODS[method])
    got = model(ids, labels=labels)
    got.loss.backward()
    problems = []
    for name in ("logits", "loss", "aux_loss"):
        want = getattr(out, name).detach()
        if variant == "lp" and name == "logits":  # loss_parallel: this rank's vocab columns
            from commfuse.tp.loss import vocab_start
            start = vocab_start(model.lm_head, mesh.get_group())
            want = want[..., start:start + got.logits.shape[-1]]
        err = _rel(getattr(got, name).detach(), want)
        if err > TOL:
            problems.append(f"{name} rel {err:.1e}")
    want = dict(ref.named_parameters())
    if sorted(want) != sorted(n for n, _ in model.named_parameters()):
        problems.append("parameter names differ")
    for name, p in model.named_parameters():
        err = _rel(_full_grad(p, want[name].grad.shape, world), want[name].grad)
        if err > TOL:
            problems.append(f"grad {name} rel {err:.1e}")
    if variant == "starved":  # the case happened: only rank 0's experts got rows
        counts = model.model.layers[-1].mlp.experts.last_counts
        if rank and counts.received(rank):
            problems.append(f"starved: rank {rank} received {counts.received(rank)} rows")
        if not counts.received(0):
            problems.append("starved: rank 0 received nothing")
    return problems


def _batches(steps: int, rows=slice(None)):
    """Two batches of 4 x 12 taken in turn (rows ``rows``), labels the next token."""
    two = torch.randint(63, (2, 4, 12), generator=torch.Generator().manual_seed(5))
    ids = two[torch.arange(steps) % 2][:, rows]
    return ids, ids.roll(-1, 2)


def _check_train(arch: str, mesh) -> dict[str, list[str]]:
    """``STEPS`` steps per method of ``TRAIN`` against one process: the same losses
    (float64)."""
    import commfuse.tp as tp
    from test_tp import _train
    want = _train(build(arch, mesh.size()), None, *_batches(STEPS, slice(0, 2)), STEPS)
    out = {}
    for method in TRAIN[arch]:
        model = tp.parallelize(build(arch, mesh.size()), mesh, method=method, **METHODS[method])
        got = _train(model, None, *_batches(STEPS, slice(0, 2)), STEPS)
        err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        ok = err < TOL and want[-1] < want[0] - 0.5  # equal, and it learned something
        out[f"train-{arch}-{method}"] = [] if ok else [f"losses {got} vs {want} ({err:.1e})"]
    return out


def _check_fsdp() -> list[str]:
    """FSDP2 over "dp" x experts and TPSP over "tp" on a 2 x 2 mesh: 4 steps' losses equal one
    process's. Without the aux loss: each dp rank's is its own rows' (as under any data
    parallelism of the model), not the whole batch's."""
    from test_tp import _train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import commfuse.tp as tp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, model = build("mixtral", 2), build("mixtral", 2)
    ref.router_aux_loss_coef = model.router_aux_loss_coef = 0.0
    want = _train(ref, None, *_batches(4), 4)
    tp.parallelize(model, mesh, method="commfuse")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    r = mesh.get_local_rank("dp")
    got = _train(model, mesh["dp"], *_batches(4, slice(2 * r, 2 * r + 2)), 4)
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return [] if err < TOL else [f"losses {got} vs {want} ({err:.1e})"]


def _raises(fn, kind, match: str) -> list[str]:
    try:
        fn()
    except kind as e:
        return [] if match in str(e) else [f"{match!r} not in {e}"]
    except Exception as e:  # noqa: BLE001 - reported as the failure
        return [f"{type(e).__name__} instead of {kind.__name__}: {e}"]
    return [f"no {kind.__name__}"]


def _check_errors(mesh) -> dict[str, list[str]]:
    """Bad input raises on every rank (each rank reports; the run returning is the no-hang)."""
    import commfuse.tp as tp
    from commfuse.moe.parallel import expert_ffn
    from commfuse.ops.moe.counts import CountsError
    world, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    out = {"error-not-divisible": _raises(
        lambda: tp.parallelize(build("mixtral", world, num_local_experts=world + 1), mesh),
        ValueError, "experts cannot be split"),
        "error-router-noise": _raises(
        lambda: tp.parallelize(build("mixtral", world, router_jitter_noise=0.1), mesh), ValueError,
        "router_jitter_noise")}
    x = torch.randn(5, 4, dtype=torch.float64)
    w_in, w_out = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    idx = torch.zeros(5, 1, dtype=torch.long)

    def ffn(experts, index):
        expert_ffn(x, torch.ones(5, 1, dtype=torch.float64), index, w_in, w_out,
                   lambda h: h[:, :3] * h[:, 3:], group, experts, method="commfuse", timeout=30)

    # rank 0 counts 2 experts per rank, the others 3: the tables do not fit together
    out["error-counts-disagree"] = _raises(lambda: ffn(2 * world if rank == 0 else 3 * world, idx),
                                           CountsError, "different numbers of experts")
    # the last rank routes a token to an expert that does not exist
    bad = idx.clone()
    bad[0] = 2 * world if rank == world - 1 else 0
    out["error-expert-out-of-range"] = _raises(lambda: ffn(2 * world, bad), CountsError,
                                               f"ranks [{world - 1}] route to experts outside")
    return out


def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for arch, method, variant in CASES[world]:
        out[f"exact-{arch}-{method}{'-' + variant if variant else ''}"] = \
            _check_exact(arch, method, mesh, variant)
    if world == 2:
        for arch in ARCHS:
            out.update(_check_train(arch, mesh))
    if world == 4:
        out["fsdp2-mixtral-commfuse"] = _check_fsdp()
    out.update(_check_errors(mesh))
    return out


# every method on 2 ranks; on 3 and 4 (uneven and finer expert splits) the fused ones
CASES = {w: [(a, m, "") for a in ARCHS for m in (METHODS if w == 2 else ("commfuse", "auto"))]
         + [(a, m, "starved") for a in ARCHS for m in ("none", "commfuse")]
         + [("mixtral", "commfuse", "lp")] for w in (2, 3, 4)}  # lp: loss_parallel
CASES[4] += [("mixtral", m, "short") for m in ("none", "commfuse")]


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, timeout=600, pg_timeout_s=60)


IDS = [(w, f"exact-{a}-{m}{'-' + v if v else ''}") for w in CASES for a, m, v in CASES[w]]
IDS += [(2, f"train-{a}-{m}") for a in ARCHS for m in TRAIN[a]]
IDS += [(4, "fsdp2-mixtral-commfuse")]
IDS += [(w, f"error-{e}") for w in CASES for e in ("not-divisible", "router-noise",
                                                   "counts-disagree", "expert-out-of-range")]


@pytest.mark.parametrize("world,case", IDS, ids=[f"{w}-{c}" for w, c in IDS])
def test_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


def test_unknown_moe_layout_is_refused_by_name():
    """No processes: expert parameters the layout does not name are refused by name."""
    from commfuse.tp.plan import derive_plan
    model = build("mixtral", 2)
    model.model.layers[1].mlp.experts.register_parameter(
        "gate_up_proj_bias", torch.nn.Parameter(torch.zeros(8, 48)))
    with pytest.raises(ValueError, match="gate_up_proj_bias"):
        derive_plan(model, 2)

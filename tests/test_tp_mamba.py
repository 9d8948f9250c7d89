"""commfuse.tp's derived plan on Mamba-2 mixers: transformers' Mamba2ForCausalLM and the hybrids
BambaForCausalLM (a Mamba-2 layer and an attention layer) and NemotronHForCausalLM (Mamba-2,
MLP and attention layers) against the unsharded model (the tiny configs of
`commfuse.tp.families`, float32, the mixer's torch path, gloo); Falcon-H1's and Granite
4.0-H's mixer variants beyond their families' tests.

One spawn per world size runs every case: each rank builds the reference model from the seed,
computes its logits, loss and gradients in one process, then parallelizes a copy with
`commfuse.tp.parallelize` and compares logits, loss and every parameter's full gradient
(``grad.full_tensor()``; in_proj and conv1d are DTensors of the assembled rows, compared with
the reference gradient's rows ``MixerLayout.in_rows()`` / ``conv_rows()``, which also checks
that replicated B/C rows got equal gradients); training (2 ranks) runs AdamW steps of both and
compares the losses. The layouts: 2 B/C groups (split on 2 ranks, replicated on 4), 1 group
(replicated on every rank, the gated norm's statistics summed over ranks), 4 groups with
in_proj / out_proj biases (split on 2 and 4), a padding mask, bfloat16, and Bamba (its kv heads
replicated on 4 ranks: their gradients compared block-repeated), also under FSDP2 over "dp"
of a 2 x 2 mesh, and Nemotron-H (a Mamba-2 layer with conv bias, a squared-ReLU MLP layer and
an attention layer without RoPE, its 2 kv heads replicated on 4 ranks), and Nemotron-H with
MoE layers (routed experts over the ranks, a shared expert, a score-correction bias; also
with latent projections, replicated per token); Falcon-H1 without its gated norm and with the
gate before it over one replicated group, Granite 4.0-H with RoPE over one group and its
router's auxiliary loss (tests/test_tp_families.py's check); a forward without gradients of
fewer tokens than ranks (every token on every rank). The no-process tests check the layout
and what the plan refuses.
"""

import copy
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from test_tp import outputs_match

# the tiny models are the families' (`commfuse.tp.families`: mamba2, bamba, nemotron-h) with
# these layouts: 2 B/C groups (split on 2 ranks, replicated on 4), 1 group (replicated on
# every rank), 4 groups with in_proj / out_proj biases, tied embeddings
LAYOUTS = {"g2": {"n_groups": 2}, "g1": {"n_groups": 1},
           "g4-bias": {"n_groups": 4, "use_bias": True},
           "g2-tied": {"n_groups": 2, "tie_word_embeddings": True}}
FAMILY = {"bamba": "bamba", "nemotron-h": "nemotron-h", "nemotron-h-moe": "nemotron-h",
          "nemotron-h-moe-latent": "nemotron-h"}
# Nemotron-H with MoE layers ("M E * E"): 4 routed experts of 8 (squared ReLU, non-gated),
# top-2 by sigmoid scores within 1 of 2 expert groups, a score-correction bias, a shared expert
NEMOTRON_H_MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      moe_shared_expert_intermediate_size=12, n_group=2, topk_group=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True)
MOE = {"nemotron-h-moe": NEMOTRON_H_MOE,  # and with latent projections around the experts
       "nemotron-h-moe-latent": dict(NEMOTRON_H_MOE, moe_latent_size=8)}
VOCAB = 63
# Falcon-H1 and Granite 4.0-H beyond their families' configs (tests/test_tp_families.py):
# Falcon-H1 without the gated norm (y * silu(z), its config's default) and with the gate
# before the norm over 1 B/C group (replicated on every rank); Granite with RoPE, 1 group and
# the router's auxiliary loss in the loss
VARIANTS = {"falcon-h1-no-norm": ("falcon-h1", {"mamba_rms_norm": False}),
            "falcon-h1-gate-first-g1": ("falcon-h1", {"mamba_norm_before_gate": False,
                                                      "mamba_n_groups": 1}),
            "granite-4-h-rope-g1-aux": ("granite-4-h", {"position_embedding_type": "rope",
                                                        "mamba_n_groups": 1,
                                                        "output_router_logits": True,
                                                        "router_aux_loss_coef": 0.5})}
SHORT = ("g2", "g1", "bamba")  # a forward without gradients of fewer tokens than ranks
METHODS = {"none": {}, "sliced": {"chunks": 2}, "commfuse": {}, "auto": {}}
# norm-relative; float32 everywhere (the mixer keeps its scan and norm in float32 even for a
# float64 model, so float64 is not tighter), or the sharded model in bfloat16 vs float32 (the
# unsharded model in bfloat16 is itself 2-3e-2 off float32 on the D / dt_bias gradients)
TOL = {"": 1e-5, "mask": 1e-5, "bf16": 8e-2, "lp": 1e-5}
# (layout, method, variant): 11 tokens, split unevenly over 2 and 4 ranks, 3 scan chunks;
# variant "mask": a padding mask, "bf16": the sharded model in bfloat16, "lp": loss_parallel
# (vocabulary-sharded logits and loss; also a loss_function call with num_items_in_batch)
EXACT = ([("g2", m, "") for m in METHODS] + [("g1", m, "") for m in ("none", "commfuse", "auto")]
         + [("g4-bias", "commfuse", ""), ("g4-bias", "auto", ""), ("g2", "commfuse", "mask"),
            ("g2-tied", "commfuse", ""),
            ("g1", "commfuse", "bf16"), ("g1", "auto", "lp")]
         + [("bamba", m, "") for m in ("none", "commfuse", "auto")]
         + [("nemotron-h", m, "") for m in ("none", "commfuse", "auto")]
         + [("nemotron-h", "commfuse", "lp")]
         + [("nemotron-h-moe", m, "") for m in ("commfuse", "auto")]
         + [("nemotron-h-moe-latent", "commfuse", "")])
# on 4 ranks each layout's split with `commfuse` (every method's runs on 2) and the variants
EXACT_4 = [c for c in EXACT if c[1] == "commfuse" or c[2]]
# on 2 ranks (a step is the same code on 4: EXACT's gradients there, and the FSDP2 case's steps)
TRAIN = [("g2", "commfuse"), ("g1", "auto"), ("bamba", "commfuse"), ("nemotron-h", "auto"),
         ("nemotron-h", "auto-lp"), ("nemotron-h-moe", "commfuse")]
STEPS, BATCH, SEQ = 20, 4, 12


def build(layout: str, seed: int = 0, **over):
    """The tiny model of ``layout`` (a family's, or Mamba2's in one of `LAYOUTS`), float32."""
    import transformers
    from commfuse.tp.families import FAMILIES, tiny_config
    name = FAMILY.get(layout, "mamba2")
    extra = MOE.get(layout) or LAYOUTS.get(layout, {})
    cfg = tiny_config(name, **{**extra, **over})
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[name].model)(cfg).float()
    if layout in MOE:
        for layer in model.model.layers:  # a score-correction bias that changes the choices
            if layer.block_type == "moe":
                with torch.no_grad():
                    layer.mixer.gate.weight.normal_()
                    layer.mixer.gate.e_score_correction_bias.normal_(std=0.5)
    return model


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _want_grad(model, name: str, ref_grad: torch.Tensor) -> torch.Tensor:
    """The reference gradient in the parameter's own layout (in_proj / conv1d: assembled)."""
    owner, _, _ = name.rpartition(".")
    sub, _, kind = owner.rpartition(".")
    if kind in ("in_proj", "conv1d"):
        lay = model.get_submodule(sub)._commfuse_layout
        return ref_grad[lay.in_rows() if kind == "in_proj" else lay.conv_rows()]
    p = model.get_parameter(name)
    if p.shape != ref_grad.shape:  # k/v heads replicated k times: blocks b0 b1 -> b0 b0 b1 b1
        k = p.shape[0] // ref_grad.shape[0]
        blocks = ref_grad.reshape(p.device_mesh.size() // k, -1, *ref_grad.shape[1:])
        return blocks.repeat_interleave(k, 0).flatten(0, 1)
    return ref_grad


def _check_exact(layout, method, variant, mesh) -> list[str]:
    import commfuse.tp as tp
    from torch.distributed.tensor import DTensor
    ref = build(layout)
    model = copy.deepcopy(ref).to(torch.bfloat16 if variant == "bf16" else torch.float32)
    tol = TOL[variant]
    g = torch.Generator().manual_seed(11)
    ids, labels = torch.randint(VOCAB, (2, 2, 11), generator=g)
    labels[0, 2] = -100  # an ignored position
    kw = {}
    if variant == "mask":  # left padding: row 0's first 3 tokens
        kw["attention_mask"] = torch.ones_like(ids)
        kw["attention_mask"][0, :3] = 0
        labels[0, :3] = -100
    out = ref(ids, labels=labels, use_cache=False, **kw)
    out.loss.backward()
    tp.parallelize(model, mesh, method=method, loss_parallel=variant == "lp", **METHODS[method])
    got = model(ids, labels=labels, **kw)
    got.loss.backward()
    problems = outputs_match(got, out, model, ref, tol)
    if variant == "lp":  # the Trainer's call: a sum over the tokens, over num_items_in_batch
        n, V = torch.tensor(7), ref.config.vocab_size
        a = model.loss_function(got.logits.detach(), labels, V, num_items_in_batch=n)
        b = ref.loss_function(out.logits.detach(), labels, V, num_items_in_batch=n)
        if abs(a.item() - b.item()) > tol * abs(b.item()):
            problems.append(f"loss_function(num_items_in_batch=7) {a.item()} vs {b.item()}")
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            problems.append(f"{name} is not a DTensor")
            continue
        if name.endswith("in_proj.weight"):  # the assembled weight maps back to the model's
            lay = model.get_submodule(name[:-len(".in_proj.weight")])._commfuse_layout
            full = lay.to_model(p.full_tensor().detach(), lay.in_rows())
            if not torch.equal(full, want[name].detach().to(full.dtype)):
                problems.append(f"{name}: to_model(full_tensor()) is not the model's weight")
        w = _want_grad(model, name, want[name].grad)
        if p.grad is None or _rel(p.grad.full_tensor(), w) > tol:
            problems.append(f"grad {name} rel "
                            f"{'none' if p.grad is None else f'{_rel(p.grad.full_tensor(), w):.1e}'}")
    return problems


def _train(model, ids, labels, tensors: bool = False) -> list:
    """The losses of ``len(ids)`` AdamW steps (floats, or detached tensors)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(len(ids)):
        loss = model(ids[step], labels=labels[step], use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach() if tensors else loss.item())
    return losses


def _batches(steps: int):
    """Two batches taken in turn (so the loss falls), labels the next token."""
    two = torch.randint(VOCAB, (2, BATCH, SEQ),
                        generator=torch.Generator().manual_seed(5))
    ids = two[torch.arange(steps) % 2]
    return ids, ids.roll(-1, 2)


def _check_train(layout, method, mesh) -> list[str]:
    """``STEPS`` AdamW steps (`_batches`)."""
    import commfuse.tp as tp
    ids, labels = _batches(STEPS)
    want = _train(build(layout), ids, labels)
    method, _, lp = method.partition("-")
    got = _train(tp.parallelize(build(layout), mesh, method=method, loss_parallel=lp == "lp"),
                 ids, labels)
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    ok = err < 1e-4 and want[-1] < want[0] - 0.5  # and it learned something
    return [] if ok else [f"losses {got} vs {want} (max rel {err:.1e})"]


def _check_variant(name: str, mesh) -> list[str]:
    """`VARIANTS`' ``name`` through tests/test_tp_families.py's check (method commfuse)."""
    import dataclasses

    from commfuse.tp.families import FAMILIES
    from test_tp_families import _check
    family, over = VARIANTS[name]
    fam = FAMILIES[family]
    return _check(dataclasses.replace(fam, tiny={**fam.tiny, **over}), "commfuse", mesh)


def _check_short(layout, mesh) -> list[str]:
    """World - 1 tokens without gradients: every rank runs every token (the replicated
    split: the mixer's GEMM local), the logits the unsharded model's."""
    import commfuse.tp as tp
    ref = build(layout)
    model = tp.parallelize(copy.deepcopy(ref), mesh, method="commfuse")
    ids = torch.randint(VOCAB, (2, mesh.size() - 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids, use_cache=False).logits
    return [] if _rel(got, want) < TOL[""] else [f"logits rel {_rel(got, want):.1e}"]


def _check_fsdp(method) -> list[str]:
    """FSDP2 (fully_shard over "dp") x commfuse TP (over "tp") of Bamba on a 2 x 2 mesh: each
    dp rank trains on its half of every batch; the dp-averaged losses equal one process's."""
    import torch.distributed as dist
    import commfuse.tp as tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids, labels = _batches(8)
    want = _train(build("bamba"), ids, labels)
    model = tp.parallelize(build("bamba"), mesh, method=method)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    half = BATCH // 2
    rows = slice(mesh.get_local_rank("dp") * half, (mesh.get_local_rank("dp") + 1) * half)
    got = []
    for loss in _train(model, ids[:, rows], labels[:, rows], tensors=True):
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        got.append(loss.item() / 2)
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return [] if err < 1e-4 else [f"losses {got} vs {want} (max rel {err:.1e})"]


def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for layout, method, variant in EXACT if world == 2 else EXACT_4:
        case = f"exact-{layout}-{method}{'-' * bool(variant)}{variant}"
        try:
            out[case] = _check_exact(layout, method, variant, mesh)
        except Exception as e:  # one broken case must not hide the others' results
            out[case] = [f"{type(e).__name__}: {e}"]
    for layout, method in TRAIN if world == 2 else ():
        try:
            out[f"train-{layout}-{method}"] = _check_train(layout, method, mesh)
        except Exception as e:
            out[f"train-{layout}-{method}"] = [f"{type(e).__name__}: {e}"]
    for name in VARIANTS:
        try:
            out[f"variant-{name}"] = _check_variant(name, mesh)
        except Exception as e:
            out[f"variant-{name}"] = [f"{type(e).__name__}: {e}"]
    for layout in SHORT:
        try:
            out[f"short-{layout}"] = _check_short(layout, mesh)
        except Exception as e:
            out[f"short-{layout}"] = [f"{type(e).__name__}: {e}"]
    if world == 4:
        try:
            out["fsdp2-bamba-commfuse"] = _check_fsdp("commfuse")
        except Exception as e:
            out["fsdp2-bamba-commfuse"] = [f"{type(e).__name__}: {e}"]
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, timeout=600, pg_timeout_s=60)


CASES = [(w, f"exact-{l}-{m}{'-' * bool(v)}{v}") for w in (2, 4)
         for l, m, v in (EXACT if w == 2 else EXACT_4)]
CASES += [(2, f"train-{l}-{m}") for l, m in TRAIN] + [(4, "fsdp2-bamba-commfuse")]
CASES += [(w, f"variant-{n}") for w in (2, 4) for n in VARIANTS]
CASES += [(w, f"short-{l}") for w in (2, 4) for l in SHORT]


@pytest.mark.parametrize("world,case", CASES, ids=[f"{w}-{c}" for w, c in CASES])
def test_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


# --- no processes: the layout, and what parallelize refuses --------------------------------

def test_layout_rows_are_each_ranks_heads_and_groups():
    from commfuse.tp.mixers.mamba import MixerLayout
    # H=4 heads of P=1, G=2 groups of N=1: in_proj rows z 0-3, x 4-7, B 8-9, C 10-11, dt 12-15;
    # with G=1: B 8, C 9, dt 10-13
    split = MixerLayout(heads=4, head_dim=1, groups=2, state=1, world=2)
    assert split.in_rows(1).tolist() == [2, 3, 6, 7, 9, 11, 14, 15]
    assert split.conv_rows(1).tolist() == [2, 3, 5, 7]  # conv channels x 0-3, B 4-5, C 6-7
    repl = MixerLayout(heads=4, head_dim=1, groups=1, state=1, world=4)  # G < T: replicated
    assert repl.replicas == 4 and repl.in_rows(3).tolist() == [3, 7, 8, 9, 13]
    assert repl.in_rows().shape == (4 * 5,)
    w = torch.randn(14, 3)  # in_proj of H=4, G=1, N=1: z 4, x 4, B 1, C 1, dt 4 rows
    assert torch.equal(repl.to_model(w[repl.in_rows()], repl.in_rows()), w)
    c = torch.randn(6, 1, 4)  # conv1d: x 4, B 1, C 1 channels
    assert torch.equal(repl.to_model(c[repl.conv_rows()], repl.conv_rows()), c)


def _refused(model, T: int, match: str) -> None:
    from commfuse.tp.plan import derive_plan
    with pytest.raises(ValueError, match=match):
        derive_plan(model, T)


@pytest.mark.parametrize("over,T,match", [
    ({"num_heads": 6, "head_dim": 4, "hidden_size": 12}, 4,
     r"mixer: num_heads \(6\) must be divisible by the TP size \(4\)"),
    ({"num_heads": 6, "head_dim": 4, "hidden_size": 12, "n_groups": 3}, 2,
     r"n_groups \(3\) and the TP size \(2\) must divide one another"),
])
def test_plan_rejects(over, T, match):
    _refused(build("g2", **over), T, match)


@pytest.mark.parametrize("over,T,match", [
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "mamba_n_heads": 8}, 8,
     r"num_attention_heads \(4\) must be divisible by the TP size \(8\)"),
    ({"mamba_n_groups": 3}, 4, r"model\.layers\.0\.mamba: n_groups \(3\) and the TP size \(4\)"),
])
def test_plan_rejects_hybrid(over, T, match):
    _refused(build("bamba", **over), T, match)


def test_plan_names_what_is_missing():
    from commfuse.tp.mixers.mamba import is_mamba2, mixer_layout
    model = build("g2")
    del model.backbone.layers[1].mixer.chunk_size  # its parts, but not its sizes
    _refused(model, 2, r"backbone\.layers\.1\.mixer \(Mamba2Mixer\) is not a Mamba-2 mixer: "
                       r"missing chunk_size")
    model = build("g2")
    del model.backbone.layers[1].mixer.dt_bias  # not a Mamba-2 mixer: its parts uncovered
    assert not is_mamba2(model.backbone.layers[1].mixer)
    _refused(model, 2, r"backbone\.layers\.1\.mixer \(Mamba2Mixer\) has parameters "
                       r"\['A_log', 'D'\]")
    with pytest.raises(ValueError, match=r"not a Mamba-2 mixer: missing in_proj, conv1d"):
        mixer_layout(torch.nn.Linear(2, 2), 2)


def test_plan_refuses_nemotron_h_moe_experts_not_divisible():
    from commfuse.tp.plan import derive_plan
    derive_plan(build("nemotron-h-moe"), 4)  # 4 experts on 4 ranks: one each
    _refused(build("nemotron-h-moe", n_routed_experts=6, n_group=1), 4,
             r"model\.layers\.1\.mixer: 6 experts cannot be split over 4 ranks")


def test_loss_parallel_refuses_a_z_loss():
    from commfuse.tp.loss import check_loss_parallel
    check_loss_parallel(build("bamba"))
    with pytest.raises(ValueError, match=r"z-loss \(z_loss_coefficient=0\.1\) .* loss_parallel=False"):
        check_loss_parallel(build("bamba", z_loss_coefficient=0.1))

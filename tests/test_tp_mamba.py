"""commfuse.tp on transformers' Mamba2ForCausalLM and the hybrids BambaForCausalLM (a Mamba-2
layer and an attention layer) and NemotronHForCausalLM (Mamba-2, MLP and attention layers) against the unsharded model (tiny random configs, float32, the
mixer's torch path, gloo).

One spawn per world size runs every case: each rank builds the reference model from the seed,
computes its logits, loss and gradients in one process, then parallelizes a copy with
`commfuse.tp.parallelize` and compares logits, loss and every parameter's full gradient
(``grad.full_tensor()``; in_proj and conv1d are DTensors of the assembled rows, compared with
the reference gradient's rows ``MixerLayout.in_rows()`` / ``conv_rows()``, which also checks
that replicated B/C rows got equal gradients); training runs AdamW steps of both and compares
the losses. The layouts: 2 B/C groups (split on 2 ranks, replicated on 4), 1 group
(replicated on every rank, the gated norm's statistics summed over ranks), 4 groups with
in_proj / out_proj biases (split on 2 and 4), a padding mask, bfloat16, and Bamba (its kv heads
replicated on 4 ranks: their gradients compared block-repeated), also under FSDP2 over "dp"
of a 2 x 2 mesh, and Nemotron-H (a Mamba-2 layer with conv bias, a squared-ReLU MLP layer and
an attention layer without RoPE, its 2 kv heads replicated on 4 ranks), and Nemotron-H with
MoE layers (routed experts over the ranks, a shared expert, a score-correction bias).
"""

import copy
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from test_tp import outputs_match

CFG = dict(vocab_size=63, hidden_size=16, expand=2, num_heads=8, head_dim=4, state_size=8,
           chunk_size=4, num_hidden_layers=2, conv_kernel=4, tie_word_embeddings=False)
LAYOUTS = {"g2": {"n_groups": 2}, "g1": {"n_groups": 1},
           "g4-bias": {"n_groups": 4, "use_bias": True},
           "g2-tied": {"n_groups": 2, "tie_word_embeddings": True}}
# the hybrid: layer 0 Mamba-2 (2 groups), layer 1 attention (4 heads, 2 kv heads), SwiGLU MLPs
BAMBA = dict(vocab_size=63, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
             attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
             mamba_n_heads=8, mamba_d_head=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
             mamba_expand=2, mamba_chunk_size=4, max_position_embeddings=64,
             tie_word_embeddings=False)
# Nemotron-H's pattern "M-*-": Mamba-2 (2 groups), MLP, attention (4 heads, 2 kv heads), MLP
NEMOTRON_H = dict(vocab_size=63, hidden_size=16, intermediate_size=24,
                  layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=4, mamba_num_heads=8,
                  mamba_head_dim=4, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
# Nemotron-H with MoE layers ("M E * E"): 4 routed experts of 8 (squared ReLU, non-gated),
# top-2 by sigmoid scores within 1 of 2 expert groups, a score-correction bias, a shared expert
NEMOTRON_H_MOE = dict(NEMOTRON_H, layers_block_type=["linear_attention", "moe",
                                                     "full_attention", "moe"],
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      moe_shared_expert_intermediate_size=12, n_group=2, topk_group=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True)
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
         + [("nemotron-h-moe", m, "") for m in ("commfuse", "auto")])
TRAIN = [("g2", "commfuse"), ("g1", "auto"), ("bamba", "commfuse"), ("nemotron-h", "auto"),
         ("nemotron-h", "auto-lp"), ("nemotron-h-moe", "commfuse")]
TRAIN_2_ONLY = {("nemotron-h", "auto-lp"), ("nemotron-h-moe", "commfuse")}  # 4 ranks: EXACT's
STEPS, BATCH, SEQ = 20, 4, 12


def build(layout: str, seed: int = 0, **over):
    import transformers
    if layout == "bamba":
        cfg = transformers.BambaConfig(**{**BAMBA, **over})
        torch.manual_seed(seed)
        return transformers.BambaForCausalLM(cfg).float()
    if layout in ("nemotron-h", "nemotron-h-moe"):
        cfg = transformers.NemotronHConfig(**{**(NEMOTRON_H if layout == "nemotron-h"
                                                 else NEMOTRON_H_MOE), **over})
        torch.manual_seed(seed)
        model = transformers.NemotronHForCausalLM(cfg).float()
        for layer in model.model.layers:  # a score-correction bias that changes the choices
            if layer.block_type == "moe":
                with torch.no_grad():
                    layer.mixer.gate.weight.normal_()
                    layer.mixer.gate.e_score_correction_bias.normal_(std=0.5)
        return model
    cfg = transformers.Mamba2Config(**{**CFG, **LAYOUTS[layout], **over})
    torch.manual_seed(seed)
    return transformers.Mamba2ForCausalLM(cfg).float()


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
    ids, labels = torch.randint(CFG["vocab_size"], (2, 2, 11), generator=g)
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
    two = torch.randint(CFG["vocab_size"], (2, BATCH, SEQ),
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
    for layout, method, variant in EXACT:
        case = f"exact-{layout}-{method}{'-' * bool(variant)}{variant}"
        try:
            out[case] = _check_exact(layout, method, variant, mesh)
        except Exception as e:  # one broken case must not hide the others' results
            out[case] = [f"{type(e).__name__}: {e}"]
    for layout, method in TRAIN:
        if world != 2 and (layout, method) in TRAIN_2_ONLY:
            continue
        try:
            out[f"train-{layout}-{method}"] = _check_train(layout, method, mesh)
        except Exception as e:
            out[f"train-{layout}-{method}"] = [f"{type(e).__name__}: {e}"]
    if world == 4:
        try:
            out["fsdp2-bamba-commfuse"] = _check_fsdp("commfuse")
        except Exception as e:
            out["fsdp2-bamba-commfuse"] = [f"{type(e).__name__}: {e}"]
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, timeout=600, pg_timeout_s=60)


CASES = [(w, f"exact-{l}-{m}{'-' * bool(v)}{v}") for w in (2, 4) for l, m, v in EXACT]
CASES += [(w, f"train-{l}-{m}") for w in (2, 4) for l, m in TRAIN
          if w == 2 or (l, m) not in TRAIN_2_ONLY] + [(4, "fsdp2-bamba-commfuse")]


@pytest.mark.parametrize("world,case", CASES, ids=[f"{w}-{c}" for w, c in CASES])
def test_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


# --- no processes: the layout, and what parallelize refuses --------------------------------

def test_layout_rows_are_each_ranks_heads_and_groups():
    from commfuse.tp.mamba import MixerLayout
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
    from commfuse.tp.mamba import is_mamba2, mixer_layout
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

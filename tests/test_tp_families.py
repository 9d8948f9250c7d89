"""`commfuse.tp.parallelize`'s derived plan on the transformers families of
`commfuse.tp.families` against the unsharded model (tiny configs, float32, gloo, 2 and 4
ranks): logits, loss and every parameter's gradient, then (method commfuse, 2 ranks) 3 AdamW
steps' losses. Every method runs, on 2 ranks, on one family per mechanism (packed
projections: phi3, split-dim norms: olmo2, tied embeddings and soft-capping: gemma3, sparse
MoE: glm4-moe and gpt-oss, Gated DeltaNet: qwen3.5, multi-head latent attention:
deepseek-v3-dense, attention beside a Mamba-2 mixer: falcon-h1); the other families run
`commfuse`. The no-process tests
check what the plan refuses, before any weight moves.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from commfuse.testbed.spawn import run_local
from commfuse.tp.families import FAMILIES, TWO_RANKS, build
from test_tp import TOL, _rel, outputs_match

METHODS = {"none": {}, "sliced": {"chunks": 2}, "commfuse": {}, "auto": {}}
# one per mechanism
EVERY_METHOD = ("phi3", "olmo2", "gemma3", "glm4-moe", "gpt-oss", "qwen3.5", "deepseek-v3-dense",
                "falcon-h1")
NEW = [n for n, f in FAMILIES.items() if f.test == "tests/test_tp_families.py"]
CASES = [(f, m) for f in NEW for m in (METHODS if f in EVERY_METHOD else ("commfuse",))]
# on 4 ranks each family's split with `commfuse` (every method's runs on 2 per mechanism)
WORLD_CASES = [(w, f, m) for w in (2, 4) for f, m in CASES
               if w == 2 or (f not in TWO_RANKS and m == "commfuse")]
STEPS = 3


def _model_grad(model, name: str, p, world: int) -> torch.Tensor:
    """The unsharded gradient of parameter ``name`` in the model's layout (replicated kv
    blocks once, packed and assembled rows in the model's order)."""
    from commfuse.tp.attention import unpack_rows
    mod = model.get_submodule(name.rpartition(".")[0])
    style = next((getattr(mod, a) for a in ("_commfuse_colwise", "_commfuse_split_norm",
                                            "_commfuse_rows") if hasattr(mod, a)), None)
    g = p.grad.full_tensor()
    return g if style is None else unpack_rows(style, g, world)


def _check(family, method: str, mesh, mask: bool = False, steps: int = STEPS) -> list[str]:
    """Family ``family`` (a name or a `Family`) under ``method`` against the unsharded model:
    logits, loss, every gradient; then, with ``commfuse`` on 2 ranks, ``steps`` AdamW steps.
    ``mask``: the second sequence left-padded by 3 tokens."""
    import commfuse.tp as tp
    ref = build(family)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 63, (2, 11), generator=g)  # 11 tokens: uneven shards
    labels = ids.clone()
    labels[0, 2] = -100
    kw = {}
    if mask:
        kw["attention_mask"] = torch.ones_like(ids)
        kw["attention_mask"][1, :3] = 0
        labels[1, :3] = -100
    out = ref(ids, labels=labels, **kw)
    out.loss.backward()
    tp.parallelize(model, mesh, method=method, **METHODS[method])
    got = model(ids, labels=labels, **kw)
    got.loss.backward()
    problems = outputs_match(got, out, model, ref, TOL["f32"])
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = _model_grad(model, name, p, mesh.size())
        if _rel(grad, want[name].grad) > TOL["f32"]:
            problems.append(f"grad {name} rel {_rel(grad, want[name].grad):.1e}")
    if method != "commfuse" or mesh.size() != 2:  # training: once per family
        return problems
    # AdamW steps of both, each loss compared
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(steps):
        losses = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            loss = m(ids.roll(step, 1), labels=labels.roll(step, 1), **kw).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if abs(losses[1] - losses[0]) > 1e-4 * abs(losses[0]):
            problems.append(f"step {step} loss {losses[1]} vs {losses[0]}")
    return problems


def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    return {f"{f}-{m}": _check(f, m, mesh) for w, f, m in WORLD_CASES if w == world}


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, timeout=600, pg_timeout_s=60)


@pytest.mark.parametrize("world,case", [(w, f"{f}-{m}") for w, f, m in WORLD_CASES],
                         ids=[f"{w}-{f}-{m}" for w, f, m in WORLD_CASES])
def test_family_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


# --- no processes: what the derived plan refuses --------------------------------------------

def _refused(model, T: int, match: str) -> None:
    from commfuse.tp.plan import derive_plan
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        derive_plan(model, T)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing moved


def test_refuses_a_module_no_style_covers():
    model = build("llama")
    model.model.layers[1].self_attn.extra = nn.Conv1d(4, 4, 1)
    _refused(model, 2, r"model\.layers\.1\.self_attn\.extra \(Conv1d\) has parameters")


def test_refuses_heads_that_do_not_divide():
    _refused(build("llama"), 3, r"num_attention_heads \(4\) must be divisible by the TP size")


def test_refuses_packed_qkv_with_replicated_kv_heads():
    _refused(build("phi3", num_key_value_heads=2), 4, r"packed q\|k\|v with 2 kv heads")


def test_refuses_attention_whose_heads_it_cannot_tell():
    import transformers
    cfg = transformers.GPTNeoXConfig(vocab_size=63, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=40)
    _refused(transformers.GPTNeoXForCausalLM(cfg), 2, r"attention\.query_key_value|not "
                                                      r"q_proj/k_proj/v_proj/qkv_proj")


def test_refuses_a_model_without_decoder_layers():
    import transformers
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                                vocab_size=10))
    _refused(gpt2, 2, r"does not know GPT2LMHeadModel.*ModuleList 'layers'")


def test_refuses_an_attention_indexer_across_heads():
    model = build("llama")  # Kolibri 1.1's indexer: no parameters, the first heads read
    model.model.layers[1].self_attn.indexer = nn.Module()
    _refused(model, 2, r"model\.layers\.1\.self_attn\.indexer: a sparse-attention indexer")


def test_refuses_experts_that_do_not_divide():
    _refused(build("qwen2-moe", num_experts=6), 4, r"6 experts cannot be split over 4 ranks")


def test_refuses_latent_attention_heads_that_do_not_divide():
    _refused(build("deepseek-v3-dense"), 3, r"model\.layers\.0\.self_attn: multi-head latent "
                                            r"attention with 4 heads cannot be split over 3")


def test_refuses_latent_attention_with_parts_it_does_not_know():
    model = build("deepseek-v3-dense")  # a gate on the heads' output (Bailing's g_proj)
    model.model.layers[1].self_attn.g_proj = nn.Linear(32, 4, bias=False)
    _refused(model, 2, r"model\.layers\.1\.self_attn \(DeepseekV3Attention\): a multi-head "
                       r"latent attention with parameters in \['g_proj'\]")


def test_plan_covers_every_parameter_of_each_family():
    from commfuse.tp.mixers.deltanet import DeltaNetParallel
    from commfuse.tp.experts import ExpertParallel
    from commfuse.tp.mixers.mamba import MambaMixerParallel
    from commfuse.tp.plan import derive_plan
    for name in FAMILIES:
        model = build(name)
        plan = derive_plan(model, 2)
        covered = set(plan.styles) | set(plan.head_params)
        whole = [n for n, s in plan.styles.items()  # styles that shard their submodules too
                 if isinstance(s, (DeltaNetParallel, ExpertParallel, MambaMixerParallel))]
        for n, mod in model.named_modules():
            if next(mod.parameters(recurse=False), None) is not None:
                assert n in covered or any(n.startswith(w + ".") for w in whole), (name, n)


def test_support_doc_is_the_codes():
    """docs/support.md's generated sections are the registry's and the sweep CSV's
    (regenerate: python -m commfuse.tp.families --write)."""
    from pathlib import Path

    from commfuse.tp.families import sections
    docs = Path(__file__).parent.parent / "docs"
    doc = (docs / "support.md").read_text()
    for (begin, end), text in sections(docs).items():
        assert doc.split(begin)[1].split(end)[0] == text, (
            "regenerate: python -m commfuse.tp.families --write")

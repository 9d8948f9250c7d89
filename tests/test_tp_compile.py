"""torch.compile of a transformers model sharded by `commfuse.tp.parallelize`, on 2 gloo ranks.

Each rank builds the unsharded reference (tests/test_tp.py's tiny configs), then parallelizes a
copy and compiles it (Dynamo, then AOT autograd run eagerly, through test_compile's recording
backend): logits, loss and every gradient equal the reference's; Dynamo makes one graph (no
graph break) in which each fused projection is one `commfuse.ag_matmul` and each row-parallel
linear one `commfuse.matmul_rs` custom op, in the forward and the backward, with no
point-to-point op of theirs beside them (the styles' plain collectives, such as the norms'
gradient all-reduce, are functional collectives); and test_tp's STEPS AdamW steps of the
compiled Llama (the exact case's model, on batches of its shape) give the reference's losses
without a second compilation. A tiny Qwen3-MoE (tests/test_moe_hf.py's, float64,
method auto: resolved inside the op once the counts are known) compiles to one graph too, in
which each sparse layer's experts are one ``commfuse.moe_expert_ffn`` forward and one
``commfuse.moe_expert_ffn_backward`` (`commfuse.ops.moe.library`): logits, loss, auxiliary loss
and every gradient equal the unsharded eager model's, the step's counts are left on the
experts' module, and no forward graph stays stashed after the backward.
"""

import copy
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from test_compile import Recorder
from test_tp import STEPS, TOL, _batches, _full_grad, _rel, _tokens, _train, build

# compiled, "none" is the same custom ops with another spec string (tests/test_compile.py runs
# it and the other methods on the ops themselves); a projection's bias is added outside the op,
# the same compiled as eager (test_tp checks biased plans)
CASES = [("llama", "commfuse")]
LAYERS = 2  # tests/test_tp.py's CFG


def _compiled(arch, method, mesh):
    import commfuse.tp as tp

    model = build(arch)
    tp.parallelize(model, mesh, method=method)
    rec = Recorder()
    return model, torch.compile(model, backend=rec), rec


def _check_exact(arch, method, mesh) -> tuple[list[str], torch.nn.Module, torch.nn.Module,
                                              Recorder]:
    """What differs from the reference; the reference, the compiled model and its graphs."""
    ref = build(arch)
    ids, labels = _tokens(11, 2, 11)  # 11 tokens: uneven shards
    out = ref(ids, labels=labels)
    out.loss.backward()
    model, compiled, rec = _compiled(arch, method, mesh)
    got = compiled(ids, labels=labels)
    got.loss.backward()
    problems = []
    if _rel(got.logits.detach(), out.logits.detach()) > TOL["f32"]:
        problems.append(f"logits rel {_rel(got.logits.detach(), out.logits.detach()):.1e}")
    if abs(got.loss.item() - out.loss.item()) > TOL["f32"] * abs(out.loss.item()):
        problems.append(f"loss {got.loss.item()} vs {out.loss.item()}")
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, bad = _full_grad(name, p, want[name].grad.shape, mesh.size())
        problems += bad
        if _rel(g, want[name].grad) > TOL["f32"]:
            problems.append(f"grad {name} rel {_rel(g, want[name].grad):.1e}")
    if len(rec.graphs["dynamo"]) != 1:
        problems.append(f"{len(rec.graphs['dynamo'])} Dynamo graphs (graph breaks)")
    # per layer: q|k|v and gate|up as one fused all-gather each, o_proj and down_proj one
    # reduce-scatter each; plus the head's gather of the whole logits (a plain gather)
    fwd = [t for t in rec.ops("forward") if t.startswith("commfuse.")]
    want_fwd = ["commfuse.ag_matmul", "commfuse.matmul_rs"] * (2 * LAYERS)
    if fwd[:len(want_fwd)] != want_fwd or len(fwd) != len(want_fwd) + 1:
        problems.append(f"forward graph's commfuse ops: {fwd}")
    # the fused schedules stay whole: no point-to-point op of theirs leaks into the graphs (the
    # plain collectives of the styles, e.g. the norms' gradient all-reduce, are functional ones)
    p2p = [t for t in rec.ops("forward") + rec.ops("backward") if "send" in t or "recv" in t]
    if p2p:
        problems.append(f"point-to-point ops in the graphs: {p2p}")
    if not any(t.startswith("commfuse.") for t in rec.ops("backward")):
        problems.append("no commfuse op in the backward graph")
    return problems, ref, compiled, rec


def _check_train(ref, compiled, rec) -> list[str]:
    """STEPS AdamW steps of both models from where `_check_exact` left them, on two batches
    of its shape (2 x 11) taken in turn: the losses equal, and the steps reuse its graph."""
    ids, labels = (t[:, :2] for t in _batches(STEPS, seq=11))
    for m in (ref, compiled):
        m.zero_grad(set_to_none=True)
    want = _train(ref, None, ids, labels, STEPS)
    got = _train(compiled, None, ids, labels, STEPS)
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(want, got)) if abs(a - b) > 1e-4 * abs(a)]
    graphs = len(rec.graphs["dynamo"])
    return ([f"step {i}: loss {b} vs {a}" for i, a, b in bad[:3]]
            + ([f"{graphs} Dynamo graphs after training (recompiled)"] if graphs != 1 else []))


def _check_moe(mesh) -> list[str]:
    import commfuse.tp as tp
    from commfuse.ops.moe import library
    from test_moe_hf import SEQ, TOL as MOE_TOL, build as build_moe
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    ref = build_moe("qwen3", mesh.size())  # layer 0 a dense MLP, layer 1 sparse
    ids = torch.randint(ref.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    out = ref(ids, labels=labels)
    out.loss.backward()
    model = copy.deepcopy(ref)
    tp.parallelize(model, mesh, method="auto", timeout=60)
    maybe_install_capturing_hooks(model.model)  # transformers' once-only setup (a lock), eager
    rec = Recorder()
    got = torch.compile(model, backend=rec, fullgraph=True)(ids, labels=labels)
    got.loss.backward()
    problems = [f"{n} rel {_rel(getattr(got, n).detach(), getattr(out, n).detach()):.1e}"
                for n in ("logits", "loss", "aux_loss")
                if _rel(getattr(got, n).detach(), getattr(out, n).detach()) > MOE_TOL]
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, bad = _full_grad(name, p, want[name].grad.shape, mesh.size())
        problems += bad
        if _rel(g, want[name].grad) > MOE_TOL:
            problems.append(f"grad {name} rel {_rel(g, want[name].grad):.1e}")
    moe = {k: [t for t in rec.ops(k) if "moe" in t] for k in ("forward", "backward")}
    if moe != {"forward": ["commfuse.moe_expert_ffn"],
               "backward": ["commfuse.moe_expert_ffn_backward"]}:
        problems.append(f"the graphs' MoE ops: {moe}")
    if len(rec.graphs["dynamo"]) != 1:
        problems.append(f"{len(rec.graphs['dynamo'])} Dynamo graphs (graph breaks)")
    if model.model.layers[1].mlp.experts.last_counts is None:
        problems.append("no counts left on the experts")
    if library._STASH:
        problems.append(f"{len(library._STASH)} forward graphs still stashed")
    return problems


def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for arch, method in CASES:
        out[f"exact-{arch}-{method}"], ref, compiled, rec = _check_exact(arch, method, mesh)
        if (arch, method) == ("llama", "commfuse"):
            out["train-llama-commfuse"] = _check_train(ref, compiled, rec)
    out["exact-qwen3-moe-auto"] = _check_moe(mesh)
    return out


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_local(_run, 2, timeout=600, pg_timeout_s=60)


@pytest.mark.parametrize("case", [f"exact-{a}-{m}" for a, m in CASES]
                         + ["train-llama-commfuse", "exact-qwen3-moe-auto"])
def test_compiled_parallel_hf_model_matches_unsharded(case):
    problems = {r: res[case] for r, res in enumerate(results()) if res[case]}
    assert not problems, problems

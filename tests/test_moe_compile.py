"""torch.compile of transformers' Qwen3MoeForCausalLM under `commfuse.tp.parallelize` (TPSP
attention, experts split over the same 2 gloo ranks), float64: logits, loss (with the
router's auxiliary loss) and every gradient equal the unsharded eager model's; Dynamo makes
one graph (``fullgraph=True``) in which each MoE layer's experts are one
``commfuse.moe_expert_ffn`` custom op in the forward and one ``commfuse.moe_expert_ffn_backward``
in the backward (`commfuse.ops.moe.library`); the compiled forward leaves its counts on the
experts' module as the eager one does, and no forward graph stays stashed once the backward
ran.
"""

import copy
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from test_compile import Recorder
from test_moe_hf import SEQ, TOL, _full_grad, _rel, build

METHODS = ("commfuse", "auto")  # auto: resolved inside the op, once the counts are known
MOE_LAYERS = 1  # build()'s qwen3: layer 0 a dense MLP, layer 1 sparse


def _check(method: str, mesh) -> list[str]:
    import commfuse.tp as tp
    from commfuse.ops.moe import library

    world = mesh.size()
    ref = build("qwen3", world)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(63, (2, SEQ), generator=g)
    labels = ids.roll(-1, 1)
    out = ref(ids, labels=labels)
    out.loss.backward()
    tp.parallelize(model, mesh, method=method, timeout=60)
    from transformers.utils.output_capturing import maybe_install_capturing_hooks
    maybe_install_capturing_hooks(model.model)  # transformers' once-only setup (a lock), eager
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True)
    got = compiled(ids, labels=labels)
    got.loss.backward()
    problems = []
    for name in ("logits", "loss", "aux_loss"):
        err = _rel(getattr(got, name).detach(), getattr(out, name).detach())
        if err > TOL:
            problems.append(f"{name} rel {err:.1e}")
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        err = _rel(_full_grad(p, want[name].grad.shape, world), want[name].grad)
        if err > TOL:
            problems.append(f"grad {name} rel {err:.1e}")
    fwd = [t for t in rec.ops("forward") if "moe" in t]
    bwd = [t for t in rec.ops("backward") if "moe" in t]
    if fwd != ["commfuse.moe_expert_ffn"] * MOE_LAYERS:
        problems.append(f"forward graph's MoE ops: {fwd}")
    if bwd != ["commfuse.moe_expert_ffn_backward"] * MOE_LAYERS:
        problems.append(f"backward graph's MoE ops: {bwd}")
    if len(rec.graphs["dynamo"]) != 1:
        problems.append(f"{len(rec.graphs['dynamo'])} Dynamo graphs")
    if model.model.layers[1].mlp.experts.last_counts is None:
        problems.append("no counts left on the experts")
    if library._STASH:
        problems.append(f"{len(library._STASH)} forward graphs still stashed")
    return problems


def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {m: _check(m, mesh) for m in METHODS}


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_local(_run, 2, timeout=600, pg_timeout_s=60)


@pytest.mark.parametrize("method", METHODS)
def test_compiled_moe_model_matches_unsharded(method):
    problems = {r: res[method] for r, res in enumerate(results()) if res[method]}
    assert not problems, problems

"""Expert parallelism drawn from the data-parallel ranks (`commfuse.tp.parallelize(ep=...)`,
`commfuse.tp.mesh.ep_mesh`) on 4 gloo ranks, float64, against the unsharded model run on every
data-parallel replica's batch in one process (the data-parallel loss: the mean of the
replicas' losses, router auxiliary loss included): each replica's logits and loss, every
gradient (the other weights under FSDP2 over "dp", the experts left out of it), then AdamW
steps' losses. Layouts: dp 4 with ep 2 (two groups hold the same experts), dp 4 with ep 4,
and dp 2 x tp 2 with ep 4 (each expert group two TP groups); every method on the last. Bad
input: an ep the TP size does not divide, or that does not divide the experts. DeepSeek-V3's
auxiliary-loss-free bias update from the counts over every rank, against the unsharded one.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from test_moe_hf import METHODS, TOL, _rel, build

LAYOUTS = {"dp4-ep2": (4, 1, 2), "dp4-ep4": (4, 1, 4), "dp2tp2-ep4": (2, 2, 4)}  # dp, tp, ep
CASES = [("mixtral", layout, "commfuse") for layout in LAYOUTS]
CASES += [("mixtral", "dp2tp2-ep4", m) for m in METHODS if m != "commfuse"]
CASES += [("qwen3", "dp4-ep2", "commfuse")]
STEPS = 3


def _batches(dp: int) -> torch.Tensor:
    return torch.randint(63, (dp, 2, 11), generator=torch.Generator().manual_seed(1))


def _dp_loss(model, batches) -> tuple[torch.Tensor, list]:
    """The data-parallel loss of ``model`` run on each batch: their losses' mean."""
    outs = [model(ids, labels=ids.roll(-1, 1)) for ids in batches]
    return sum(o.loss for o in outs) / len(outs), outs


def _check(arch: str, layout: str, method: str) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import commfuse.tp as tp
    from commfuse.tp.experts import expert_parameters
    dp, T, ep = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (dp, T), mesh_dim_names=("dp", "tp"))
    ref = build(arch, 4)
    model = copy.deepcopy(ref)
    batches = _batches(dp)
    mine = batches[mesh["dp"].get_local_rank()]
    loss, outs = _dp_loss(ref, batches)
    loss.backward()
    tp.parallelize(model, mesh, method=method, ep=ep, timeout=60, **METHODS[method])
    ignored = expert_parameters(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
    fully_shard(model, mesh=mesh["dp"], ignored_params=ignored)
    got = model(mine, labels=mine.roll(-1, 1))
    got.loss.backward()
    problems = []
    want = outs[mesh["dp"].get_local_rank()]
    for name in ("logits", "loss"):
        err = _rel(getattr(got, name).detach(), getattr(want, name).detach())
        if err > TOL:
            problems.append(f"{name} rel {err:.1e}")
    mean = got.loss.detach().clone()
    dist.all_reduce(mean, group=mesh["dp"].get_group())
    if _rel(mean / dp, loss.detach()) > TOL:
        problems.append(f"dp loss {mean.item() / dp} vs {loss.item()}")
    want_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.full_tensor()
        err = _rel(g, want_grads[name].grad)
        if err > TOL:
            problems.append(f"grad {name} rel {err:.1e}")
    if method != "commfuse" or arch != "mixtral":
        return problems
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        want_loss, _ = _dp_loss(ref, batches.roll(step + 1, -1))
        want_loss.backward()
        shifted = mine.roll(step + 1, -1)
        got_loss = model(shifted, labels=shifted.roll(-1, 1)).loss
        got_loss.backward()
        for opt in opts:
            opt.step()
        got_mean = got_loss.detach().clone()
        dist.all_reduce(got_mean, group=mesh["dp"].get_group())
        if _rel(got_mean / dp, want_loss.detach()) > TOL:
            problems.append(f"step {step} loss {got_mean.item() / dp} vs {want_loss.item()}")
    return problems


def _bad_input() -> list[str]:
    """Each bad ``ep`` raises ValueError on every rank before any weight moves."""
    from torch.distributed.device_mesh import init_device_mesh

    import commfuse.tp as tp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    problems = []
    for ep, kw, match in ((3, {}, "multiple of the TP size"), (6, {}, "multiple of the TP size"),
                          (4, {"num_local_experts": 6}, "6 experts cannot be split over 4")):
        try:
            tp.parallelize(build("mixtral", 4, **kw), mesh, method="none", ep=ep)
            problems.append(f"ep={ep} {kw}: no error")
        except ValueError as e:
            if match not in str(e):
                problems.append(f"ep={ep} {kw}: {e}")
    return problems


def _balance() -> list[str]:
    """DeepSeek-V3's bias update (`commfuse.tp.balance`) on dp 2 x tp 2 with ep 4: the counts
    over every rank and the updated score-correction biases equal the unsharded model's over
    both batches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import commfuse.tp as tp
    from commfuse.tp.balance import ExpertLoad
    from commfuse.tp.families import build as build_family
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = build_family("deepseek-v3", n_routed_experts=8)
    model = copy.deepcopy(ref)
    batches = _batches(2)
    want_load = ExpertLoad(ref)
    _dp_loss(ref, batches)[0].backward()
    want = want_load.take(group=dist.new_group([dist.get_rank()]))
    tp.parallelize(model, mesh, method="commfuse", ep=4)
    got_load = ExpertLoad(model)
    mine = batches[mesh["dp"].get_local_rank()]
    model(mine, labels=mine.roll(-1, 1)).loss.backward()
    got = got_load.take()
    problems = [] if all(torch.equal(g, w) for g, w in zip(got, want)) else [f"{got} vs {want}"]
    if (want_load.update_bias(want, 1e-3), got_load.update_bias(got, 1e-3)) != (1, 1):
        problems.append("not one router with a score-correction bias updated")
    for a, b in zip(want_load.routers, got_load.routers):
        if not torch.equal(a.e_score_correction_bias, b.e_score_correction_bias):
            problems.append("the updated biases differ")
    return problems


def _run(rank: int, world: int) -> dict[str, list[str]]:
    return {**{"-".join(c): _check(*c) for c in CASES}, "bad-input": _bad_input(),
            "balance": _balance()}


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_local(_run, 4, timeout=600, pg_timeout_s=60)


@pytest.mark.parametrize("case", ["-".join(c) for c in CASES] + ["bad-input", "balance"])
def test_ep_from_dp_matches_data_parallel_reference(case):
    problems = {r: res[case] for r, res in enumerate(results()) if res[case]}
    assert not problems, problems

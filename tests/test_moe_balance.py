"""MoE balancing options of `commfuse.tp` against the unsharded model, float64, on 2 gloo
ranks (tp 2) and one 4-rank layout (dp 2 x tp 2 with the experts over ep 4):

- `RouterLosses` (the sequence-level auxiliary loss and the router z-loss): the terms, the
  loss and every gradient equal the unsharded model's, with the router logits local to each
  rank (Qwen3-MoE, transformers' aux loss off) and gathered over the sequence while
  transformers records them (Mixtral, its aux loss on);
- ``capacity_factor``: the sharded model drops the rows the unsharded one does when it
  applies the rule to each rank's chunk of tokens (`commfuse.tp.balance.limit_capacity`):
  logits, loss and every gradient equal, and the same dropped fraction;
- bad coefficients and factors raise (no processes), and the capacity rule on a small case.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from test_moe_hf import TOL, _full_grad, _rel, build

COEF = dict(seq_aux=1.0, z=0.05)  # large enough that a wrong gradient of a term shows
FACTOR = 0.5  # 2 x 6 tokens on rank 0, k 2 of 8 experts: capacity 2, about a third dropped


def _build(arch: str, world: int, record: bool):
    """`test_moe_hf.build`'s model; ``record``: transformers records the router logits (its
    aux loss on)."""
    model = build(arch, world)
    model.config.output_router_logits = record
    return model


def _grads(model, ref, world: int, problems: list[str]) -> None:
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        zero = torch.zeros_like(want[name])
        g_want = want[name].grad if want[name].grad is not None else zero
        g = _full_grad(p, g_want.shape, world) if p.grad is not None else zero
        err = _rel(g, g_want)
        if err > TOL:
            problems.append(f"grad {name} rel {err:.1e}")


def _losses(arch: str, mesh) -> list[str]:
    """The router losses on tp ranks: terms, loss and gradients as the unsharded model's."""
    import commfuse.tp as tp
    from commfuse.tp.router_loss import RouterLosses
    world = mesh.size()
    ref = _build(arch, world, record=arch == "mixtral")
    model = copy.deepcopy(ref)
    ids = torch.randint(63, (2, 11), generator=torch.Generator().manual_seed(1))
    terms = RouterLosses(ref, **COEF)
    (ref(ids, labels=ids.roll(-1, 1)).loss + terms.take()).backward()
    tp.parallelize(model, mesh, method="commfuse", timeout=60)
    got = RouterLosses(model, **COEF)
    loss = model(ids, labels=ids.roll(-1, 1)).loss + got.take()
    loss.backward()
    problems = []
    for name in ("seq_aux", "z"):
        want = terms.last[name]
        if not want > 0 or _rel(got.last[name], want) > TOL:
            problems.append(f"{name} {got.last[name].item()} vs {want.item()}")
    _grads(model, ref, world, problems)
    return problems


def _capacity(mesh) -> list[str]:
    """capacity_factor on tp ranks against limit_capacity on the unsharded model."""
    import commfuse.tp as tp
    from commfuse.tp.balance import limit_capacity, take_dropped
    world = mesh.size()
    ref = build("mixtral", world)
    model = copy.deepcopy(ref)
    ids = torch.randint(63, (2, 11), generator=torch.Generator().manual_seed(2))
    limit_capacity(ref, FACTOR, ranks=world)
    out = ref(ids, labels=ids.roll(-1, 1))
    out.loss.backward()
    want_dropped = take_dropped(ref)
    tp.parallelize(model, mesh, method="commfuse", timeout=60, capacity_factor=FACTOR)
    got = model(ids, labels=ids.roll(-1, 1))
    got.loss.backward()
    problems = [f"{n} rel {e:.1e}" for n in ("logits", "loss", "aux_loss")
                if (e := _rel(getattr(got, n).detach(), getattr(out, n).detach())) > TOL]
    dropped = take_dropped(model)
    if not 0 < want_dropped < 1 or dropped != want_dropped:
        problems.append(f"dropped {dropped} vs {want_dropped}")
    _grads(model, ref, world, problems)
    return problems


def _dp_ep(mesh) -> list[str]:
    """dp 2 x tp 2, experts over ep 4 (FSDP2 over dp, experts left out): each dp rank's loss
    with its router losses and a capacity on its own batch; the gradients are the mean of
    the replicas' (the unsharded model run on each batch in one process)."""
    from torch.distributed.fsdp import fully_shard

    import commfuse.tp as tp
    from commfuse.tp.balance import limit_capacity
    from commfuse.tp.experts import expert_parameters
    from commfuse.tp.router_loss import RouterLosses
    ref = _build("qwen3", 4, record=False)
    model = copy.deepcopy(ref)
    batches = torch.randint(63, (2, 2, 11), generator=torch.Generator().manual_seed(3))
    limit_capacity(ref, FACTOR, ranks=2)
    terms = RouterLosses(ref, **COEF)
    want = []
    for ids in batches:
        want.append(ref(ids, labels=ids.roll(-1, 1)).loss + terms.take())
        (want[-1] / len(batches)).backward()
    tp.parallelize(model, mesh, method="commfuse", ep=4, timeout=60, capacity_factor=FACTOR)
    ignored = expert_parameters(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
    fully_shard(model, mesh=mesh["dp"], ignored_params=ignored)
    got = RouterLosses(model, **COEF)
    ids = batches[mesh["dp"].get_local_rank()]
    loss = model(ids, labels=ids.roll(-1, 1)).loss + got.take()
    loss.backward()
    problems = []
    err = _rel(loss.detach(), want[mesh["dp"].get_local_rank()].detach())
    if err > TOL:
        problems.append(f"loss rel {err:.1e}")
    _grads(model, ref, 2, problems)
    return problems


def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    if world == 4:
        return {"dp2tp2-ep4": _dp_ep(init_device_mesh("cpu", (2, 2),
                                                      mesh_dim_names=("dp", "tp")))}
    mesh = init_device_mesh("cpu", (world,))
    return {"losses-qwen3-local": _losses("qwen3", mesh),
            "losses-mixtral-gathered": _losses("mixtral", mesh),
            "capacity-mixtral": _capacity(mesh)}


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, timeout=600, pg_timeout_s=60)


IDS = [(2, "losses-qwen3-local"), (2, "losses-mixtral-gathered"), (2, "capacity-mixtral"),
       (4, "dp2tp2-ep4")]


@pytest.mark.parametrize("world,case", IDS, ids=[f"{w}-{c}" for w, c in IDS])
def test_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


def test_capacity_keeps_the_highest_weights():
    """4 tokens, k 2 of 4 experts, factor 1: capacity 2 per expert. Expert 0 gets four rows
    (weights .6 .6 .5 .3): the two .6 stay (the tie kept whole); expert 1 gets .4 .4 .7:
    .7 and the first .4 (the lower token) stay."""
    from commfuse.moe.capacity import capacity, within_capacity
    index = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    weights = torch.tensor([[.6, .4], [.6, .4], [.5, .5], [.7, .3]])
    assert capacity(4, 2, 4, 1.0) == 2 and capacity(4, 2, 4, 1.01) == 3
    keep = within_capacity(index, weights, 4, 1.0)
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, False]]
    assert within_capacity(index, weights, 4, 4.0).all()


def test_bad_values_raise():
    from commfuse.tp.balance import limit_capacity
    from commfuse.tp.experts import ExpertParallel
    from commfuse.tp.router_loss import RouterLosses
    model = build("mixtral", 2)
    with pytest.raises(ValueError, match="z must be a finite number >= 0"):
        RouterLosses(model, z=-0.1)
    with pytest.raises(ValueError, match="seq_aux must be a finite number >= 0"):
        RouterLosses(model, seq_aux=float("nan"))
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="capacity factor must be a finite number > 0"):
            limit_capacity(model, bad)
        with pytest.raises(ValueError, match="capacity factor must be a finite number > 0"):
            ExpertParallel(capacity_factor=bad)

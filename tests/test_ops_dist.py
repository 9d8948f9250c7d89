"""Every op x method x dim x dtype on 2, 3 and 4 gloo ranks, against the unsharded reference.

Each world size is started once (real processes, `commfuse.testbed.spawn.run_local`) and runs all
cases; each case is then reported as its own test, failing if any rank saw a difference.
"""

import functools

import pytest

from commfuse.testbed.spawn import run_local
from dist_cases import all_cases, run_cases

CASES = all_cases()


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(run_cases, world, CASES, timeout=900, pg_timeout_s=60)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_unsharded_reference(world, case):
    problems = {r: res[case.id] for r, res in enumerate(results(world)) if res[case.id]}
    assert not problems, problems


def _some_outputs_unused(rank: int, world: int) -> list[str]:
    """AG->GEMM where each rank uses other outputs (even ranks only A, odd ranks only Y), so
    which output grads reach the backward differs by rank: the ranks' backward collectives
    must still match, and the gradients equal the float64 reference."""
    import torch

    import commfuse
    from commfuse.ops.registry import BASIC_VARIANTS
    from commfuse.schedule import VARIANTS

    problems = []
    for label in BASIC_VARIANTS:
        method, opts = VARIANTS[label]
        for save in (False, True):
            g = torch.Generator().manual_seed(world)
            sizes = commfuse.even_sizes(2 * world + 1, world)
            full = torch.randn(sum(sizes), 5, generator=g, dtype=torch.float64, requires_grad=True)
            bs = [torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
                  for _ in range(world)]
            gouts = [torch.randn(sum(sizes), 5 if p % 2 == 0 else 3, generator=g,
                                 dtype=torch.float64) for p in range(world)]
            sum((full if p % 2 == 0 else full @ bs[p]).mul(gouts[p]).sum()
                for p in range(world)).backward()
            off = sum(sizes[:rank])
            a = full.detach()[off:off + sizes[rank]].clone().requires_grad_()
            b = bs[rank].detach().clone().requires_grad_()
            a_full, (y,) = commfuse.fused_all_gather_matmul(a, [b], 0, method=method, sizes=sizes,
                                                            save_gathered=save, **opts)
            (a_full if rank % 2 == 0 else y).mul(gouts[rank]).sum().backward()
            for name, x, ref in (("grad A", a.grad, full.grad[off:off + sizes[rank]]),
                                 ("grad B", b.grad, torch.zeros_like(b) if bs[rank].grad
                                  is None else bs[rank].grad)):  # even ranks: no Y, dB = 0
                if x is None or not torch.allclose(x, ref, atol=1e-10):
                    problems.append(f"{label} save_gathered={save}: {name} differs")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_using_different_outputs(world):
    res = run_local(_some_outputs_unused, world, timeout=120, pg_timeout_s=30)
    assert res == [[]] * world, res

"""Bitwise repeatability: the same call with the same inputs gives bitwise the same outputs
and gradients, for every op and every method (collectives of the backend and P2P, ring and
direct, sub-slices, auto), on 2, 3 and 4 ranks, several times over, with 2 intra-op threads
per rank, uneven slices. Every sum in commfuse runs in a fixed order (the schedule's,
or rank order), never in order of arrival."""

import functools

import pytest
import torch

from commfuse.ops import registry
from commfuse.schedule import OPS
from commfuse.testbed.spawn import run_local
from dist_cases import METHODS

REPEATS = 3
LAYOUTS = ((1, True),)  # (dim, uneven slices): dim 1 of 3-D A, sizes S-1, S+2, S-1, ...
S, MID, K, N = 12, 2, 40, 24  # rows per rank, other leading dim, contraction, columns


def _once(op, method, opts, a, bs, dim, sizes):
    a = a.clone().requires_grad_()
    bs = [b.clone().requires_grad_() for b in bs]
    outs = registry.outputs(op, a, bs, method, opts, dim=dim,
                            **({"sizes": sizes} if sizes else {}))
    sum((o * (1 + i)).sum() for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs] + [a.grad] + [b.grad for b in bs]


def _repeat(rank, world):
    """{case: None if every repeat equals the first bitwise, else what differed}."""
    results = {}
    for op in OPS:
        whole = registry.get(op).whole_input
        for dim, uneven in LAYOUTS:
            sizes = tuple(S - 1 + 3 * (p % 2) for p in range(world)) if uneven else None
            rows = (sum(sizes) if whole else sizes[rank]) if uneven else (
                world * S if whole else S)
            g = torch.Generator().manual_seed(100 * world + 10 * rank + dim)
            shape = (rows, MID, K) if dim == 0 else (MID, rows, K)
            a = torch.randn(*shape, generator=g)
            bs = [torch.randn(*registry.b_shape(op, world, K, N), generator=g)
                  for _ in range(2 if op == "ag_matmul" else 1)]
            for method, opts in METHODS:
                case = f"{op}-{method}{sorted(opts.items())}-dim{dim}{'-uneven' if uneven else ''}"
                try:
                    first = _once(op, method, opts, a, bs, dim, sizes)
                    for i in range(1, REPEATS):
                        got = _once(op, method, opts, a, bs, dim, sizes)
                        bad = [j for j, (x, y) in enumerate(zip(first, got))
                               if not torch.equal(x, y)]
                        if bad:
                            raise AssertionError(f"repeat {i}: tensors {bad} differ")
                    results[case] = None
                except Exception as e:
                    results[case] = f"{type(e).__name__}: {e}"
    return results


@functools.lru_cache(maxsize=None)
def _results(world):
    return run_local(_repeat, world, timeout=600, threads=2)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_repeated_calls_are_bitwise_identical(world):
    per_rank = _results(world)
    assert len(per_rank[0]) == len(OPS) * len(LAYOUTS) * len(METHODS)
    bad = {(r, case): why for r, res in enumerate(per_rank) for case, why in res.items() if why}
    assert not bad, bad

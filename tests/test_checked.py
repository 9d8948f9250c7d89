"""Checked mode (``check=True`` / ``COMMFUSE_CHECK=1``): shapes that do not fit together across
the ranks raise `ShapeMismatchError` on every rank, naming the op and what each rank has;
shapes that fit give the unchecked result."""

import os

import pytest
import torch

from commfuse.errors import ShapeMismatchError
from commfuse.ops import registry
from commfuse.schedule import OPS
from commfuse.testbed.spawn import run_local

K, N = 8, 3


def _mismatched(rank, world, how):
    """Every op with rank p's sequence dim 3 + p rows (a slice or the whole dim, no sizes)."""
    out = {}
    if how == "env":
        os.environ["COMMFUSE_CHECK"] = "1"
    for op in OPS:
        rows = 3 + rank if not registry.get(op).whole_input else 3 * world + rank
        a = torch.randn(rows, 2, K)
        b = torch.randn(*registry.b_shape(op, world, K, N))
        opts = {"check": True} if how == "flag" else {}
        try:
            registry.call(op, a, b, "commfuse", opts, timeout=20)
            out[op] = "no error"
        except ShapeMismatchError as e:
            out[op] = str(e)
    # sizes that differ between ranks: every slice fits its own list
    a = torch.randn(3 + rank, K)
    sizes = [3 + p if p <= rank else 3 for p in range(world)]
    try:
        registry.call("ag_matmul", a, torch.randn(K, N), "sliced",
                      {"check": True} if how == "flag" else {}, sizes=sizes, timeout=20)
        out["sizes"] = "no error"
    except ShapeMismatchError as e:
        out["sizes"] = str(e)
    return out


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_shapes_raise_on_every_rank(world, how):
    for rank, out in enumerate(run_local(_mismatched, world, how, timeout=180)):
        for op, msg in out.items():
            assert msg.startswith(f"commfuse {op if op != 'sizes' else 'ag_matmul'} (checked"), \
                (rank, op, msg)
            for p in range(world):  # every rank's size is named
                assert f"rank {p}: " in msg, (rank, op, msg)
        rows = ", ".join(f"rank {p}: {3 + p}" for p in range(world))
        assert f"rows {rows}" in out["ag_matmul"] and f"rows {rows}" in out["matmul_a2a"], out
        assert "pass sizes=" in out["ag_matmul"] and "same length" in out["matmul_rs"], out
        lists = ", ".join(f"rank {r}: {tuple(3 + p if p <= r else 3 for p in range(world))}"
                          for r in range(world))
        assert f"sizes {lists}" in out["sizes"], out


def _fitting(rank, world):
    """Uneven slices with the right sizes, and even ones: checked = unchecked, bitwise."""
    torch.manual_seed(rank)
    same = []
    for op in OPS:
        sizes = tuple(2 + p for p in range(world))
        rows = sum(sizes) if registry.get(op).whole_input else sizes[rank]
        a, b = torch.randn(rows, K), torch.randn(*registry.b_shape(op, world, K, N))
        plain = registry.call(op, a, b, "commfuse", sizes=sizes)
        checked = registry.call(op, a, b, "commfuse", {"check": True}, sizes=sizes)
        same.append(torch.equal(plain, checked))
    return same


def test_fitting_shapes_pass_the_check():
    for same in run_local(_fitting, 3, timeout=120):
        assert same == [True] * len(OPS)


def test_check_must_be_a_bool():
    from commfuse.ops import checks

    with pytest.raises(TypeError, match="check must be a bool"):
        checks.checked("yes")

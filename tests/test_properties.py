"""Property-based checks (hypothesis) of every public op on a one-rank group, in process:
for any shapes, dims, dtypes and methods, either the exact result (and gradients) or a
ValueError/TypeError naming the problem, raised before any communication. Multi-rank
exactness is `test_ops_dist.py`; this hunts the edges of the argument space."""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from commfuse.ops import registry
from commfuse.schedule import OPS
from dist_cases import variants

METHODS = list(variants("none", ("sliced", {"chunks": 3}), ("decompose", {}), "commfuse",
                        ("commfuse", {"topology": "direct", "splits": 2})))


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=30))
        yield
        dist.destroy_process_group()


SEEN: dict[str, int] = {}  # outcomes of the examples run: how many of each


def test_exact_or_a_clear_error():
    """The property below, then a check that it really ran on valid arguments: a property
    that passes because every example was rejected would prove nothing."""
    SEEN.clear()
    _exact_or_a_clear_error()
    accepted = {op: SEEN.get(f"accepted {op}", 0) for op in OPS}
    assert all(n >= 5 for n in accepted.values()), SEEN  # every op, on valid arguments
    assert sum(v for k, v in SEEN.items() if k.startswith("rejected")) >= 30, SEEN


# derandomize: the same 300 examples every run, so the counts checked above cannot flake
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(OPS),
       a_shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       b_rows_delta=st.sampled_from([0, 0, 0, 1]), n=st.integers(0, 4),
       dim=st.integers(-4, 3), variant=st.sampled_from(METHODS),
       a_dtype=st.sampled_from([torch.float32] * 4 + [torch.bfloat16] * 2 + [torch.int64]),
       b_same_dtype=st.sampled_from([True] * 5 + [False]), seed=st.integers(0, 1000))
def _exact_or_a_clear_error(op, a_shape, b_rows_delta, n, dim, variant, a_dtype,
                                b_same_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(*a_shape, generator=g) * 4).to(a_dtype)
    b_dtype = a_dtype if b_same_dtype else torch.float64
    b = (torch.randn(a_shape[-1] + b_rows_delta, n, generator=g) * 4).to(b_dtype)
    if a.is_floating_point():
        a.requires_grad_()
    if b.is_floating_point():
        b.requires_grad_()
    method, opts = variant
    try:
        out = registry.call(op, a, b, method, opts, dim=dim)
    except (ValueError, TypeError) as e:
        assert str(e), "an error must say what is wrong"
        event(f"rejected: {type(e).__name__}")
        SEEN[f"rejected {type(e).__name__}"] = SEEN.get(f"rejected {type(e).__name__}", 0) + 1
        return
    event("accepted")
    # accepted: then the arguments were valid, and with one rank every op is A @ B
    assert a.dim() >= 2 and -a.dim() <= dim < a.dim() - 1 and b_rows_delta == 0
    assert a.dtype == b.dtype and a.is_floating_point()
    ref = a.detach().float() @ b.detach().float()
    tol = 1e-5 if a.dtype == torch.float32 else 2e-2
    assert out.shape == ref.shape and _close(out, ref, tol)
    out.backward(torch.ones_like(out))
    ga = torch.ones_like(ref) @ b.detach().float().t()
    gb = a.detach().float().flatten(0, -2).t() @ torch.ones_like(ref).flatten(0, -2)
    assert _close(a.grad, ga, tol) and _close(b.grad, gb, tol)
    SEEN[f"accepted {op}"] = SEEN.get(f"accepted {op}", 0) + 1  # only once fully checked


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    scale = 1 + (want.abs().max().item() if want.numel() else 0.0)
    return got.shape == want.shape and torch.allclose(got.float(), want, rtol=tol, atol=tol * scale)

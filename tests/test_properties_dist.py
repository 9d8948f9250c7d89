"""Property-based checks (hypothesis) across real ranks, for every public op and method.

Every rank draws the same examples (derandomized, no shrinking: a rank that shrank alone would
leave the others waiting) and runs its own part: shapes, uneven or empty slices, dims, dtypes,
devices, the world or a subgroup, and consistent bad input. Every example must end on every
rank of its group with the exact result (outputs and gradients against a float64 unsharded
reference, within the rounding bound of its dtype) or with the same ValueError/TypeError,
raised before any transfer; a rank that
communicated before failing would leave a peer to time out, which shows as a CommFuseError.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import commfuse
from commfuse.ops import registry
from commfuse.schedule import OPS
from commfuse.testbed.spawn import run_local
from dist_cases import variants

EXAMPLES = 200
METHODS = list(variants("none", ("sliced", {"chunks": 2}), ("sliced", {"chunks": 3}),
                        ("decompose", {}), ("commfuse", {}), "commfuse-direct",
                        ("commfuse", {"splits": 2}),
                        ("decompose", {"topology": "direct", "splits": 3}), "auto"))
BAD = [None] * 8 + ["last_dim", "k_mismatch", "dtype_mismatch", "sizes_sum", "meta_device",
                    "int_dtype"]
# Rounding bound. A sum of L products in a dtype of unit roundoff u errs by at most about
# (L + 3) u times the sum of the products' magnitudes, in any order of summation (+3: A, B and
# the output's gradient rounded to the dtype). The methods sum in different orders, so a result
# is checked against that magnitude (the reference evaluated on |A|, |B|, |dY|), not against its
# own norm, which terms that cancel make as small as they like: an output of one element summed
# from six terms can be off by 2e-5 of itself in float32 and by u of its terms. L <= 24 here:
# B's gradient sums 12 rows x mid 2. float64 counts twice (the reference errs as much);
# bfloat16 GEMMs accumulate in float32, so bfloat16 rounds A, B, dY, each slot's partial
# result and the sums over ranks and slots: (3 + 2W) u at W = 3.
_U = {dt: torch.finfo(dt).eps / 2 for dt in (torch.float32, torch.bfloat16, torch.float64)}
TOL = {torch.float32: (24 + 3) * _U[torch.float32], torch.float64: 2 * (24 + 3) * _U[torch.float64],
       torch.bfloat16: (3 + 2 * 3) * _U[torch.bfloat16]}
# Examples whose result is a few terms that nearly cancel (rank 2 holds one row of one
# element at W = 3): their error relative to their own norm is above 1e-5 in float32.
PINNED = [dict(op=op, variant=variant, group="world", sizes=[3, 3, 1, 4], explicit=True, mid=1,
               k=1, n=2, seq_dim=0, dtype=torch.float32, bad=None, seed=seed)
          for op, seed in (("matmul_a2a", 782), ("ag_matmul", 213))
          for variant in variants("auto", "none", "commfuse")]

EXAMPLE = st.fixed_dictionaries(dict(
    op=st.sampled_from(OPS),
    variant=st.sampled_from(METHODS), group=st.sampled_from(["world", "world", "sub"]),
    sizes=st.lists(st.integers(0, 4), min_size=4, max_size=4), explicit=st.booleans(),
    mid=st.integers(0, 2), k=st.integers(1, 4), n=st.integers(0, 3), seq_dim=st.integers(0, 1),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float64]),
    bad=st.sampled_from(BAD), seed=st.integers(0, 2**16)))


def _inputs(ex: dict, w: int, sizes: list[int]):
    """All ranks' float64 inputs (A per rank, one B per rank) for a group of ``w``."""
    g = torch.Generator().manual_seed(ex["seed"])
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    d, mid, k, n, op = ex["seq_dim"], ex["mid"], ex["k"], ex["n"], ex["op"]
    shape = lambda seq, last: (seq, mid, last) if d == 0 else (mid, seq, last)
    a = lambda: [rnd(*shape(registry.a_rows(op, sizes, p), k)) for p in range(w)]
    if registry.get(op).replicated_b:  # one weight, drawn first, on every rank
        b = rnd(*registry.b_shape(op, w, k, n))
        return a(), [b.clone() for _ in range(w)]
    return a(), [rnd(k, n) for _ in range(w)]


def _reference(ex: dict, a, b, sizes: list[int], r: int) -> torch.Tensor:
    d, w, op = ex["seq_dim"], len(sizes), ex["op"]
    off = sum(sizes[:r])
    if op == "ag_matmul":
        return torch.cat(a, d) @ b[r]
    if op == "matmul_rs":
        return sum(a[q] @ b[q] for q in range(w)).narrow(d, off, sizes[r])
    if op == "matmul_a2a":
        n = b[r].shape[1] // w
        return torch.cat([(a[q] @ b[q])[..., r * n:(r + 1) * n] for q in range(w)], d)
    return torch.cat([a[q].narrow(d, off, sizes[r]) for q in range(w)], -1) @ b[r]


def _call(ex: dict, a: torch.Tensor, b: torch.Tensor, group, sizes) -> torch.Tensor:
    kw = dict(timeout=10)
    if not registry.get(ex["op"]).whole_input or ex["explicit"] or ex["bad"] == "sizes_sum":
        kw["sizes"] = sizes
    return registry.call(ex["op"], a, b, *ex["variant"], dim=ex["seq_dim"], group=group, **kw)


def _spoil(ex: dict, a: torch.Tensor, b: torch.Tensor, sizes: list[int]):
    """The same bad input on every rank."""
    bad = ex["bad"]
    if bad == "last_dim":
        ex = {**ex, "seq_dim": 2}
    elif bad == "k_mismatch":
        b = torch.cat([b, b[:1]])
    elif bad == "dtype_mismatch":
        b = b.to(torch.float16)
    elif bad == "sizes_sum":  # a wrong total where ranks know it, else a wrong length
        full = registry.get(ex["op"]).whole_input
        sizes = [*sizes[:-1], sizes[-1] + 1] if full else [*sizes, 0]
    elif bad == "meta_device":
        b = b.to("meta")
    elif bad == "int_dtype":
        a, b = a.long(), b.long()
    return ex, a, b, sizes


def _one(ex: dict, rank: int, groups: dict):
    group = groups[ex["group"]]
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return ("skip",)
    w, r = group.size(), group.rank()
    sizes = ex["sizes"][:w]
    if registry.get(ex["op"]).whole_input and not ex["explicit"]:
        sizes = list(commfuse.even_sizes(sum(sizes), w))  # what the op assumes by default
    a64, b64 = _inputs(ex, w, sizes)
    # copies: in float64 a bare .to() returns the reference's own leaf, whose .grad the op
    # would then share with the reference it is checked against
    a = a64[r].to(ex["dtype"], copy=True).requires_grad_()
    b = b64[r].to(ex["dtype"], copy=True).requires_grad_()
    exs, a_in, b_in, sizes_in = _spoil(ex, a, b, sizes)
    try:
        out = _call(exs, a_in, b_in, group, sizes_in)
    except (ValueError, TypeError) as e:
        return ("error", type(e).__name__, str(e).split(":")[0][:60]) if str(e) else ("empty",)
    except Exception as e:  # a CommFuseError: some rank went on while another stopped
        return ("raised", type(e).__name__, str(e)[:300])
    if ex["bad"] is not None:
        return ("accepted bad input", ex["bad"])
    mags = [t.abs().requires_grad_() for t in a64 + b64]  # |A|, |B|: the terms' magnitudes
    leaves = [t.requires_grad_() for t in a64 + b64]
    refs = [_reference(ex, a64, b64, sizes, q) for q in range(w)]
    scales = [_reference(ex, mags[:w], mags[w:], sizes, q) for q in range(w)]
    gouts = [torch.randn(o.shape, generator=torch.Generator().manual_seed(ex["seed"] + q),
                         dtype=torch.float64) for q, o in enumerate(refs)]
    if out.shape != refs[r].shape:
        return ("wrong", "output shape", tuple(out.shape), tuple(refs[r].shape))
    sum((o * g).sum() for o, g in zip(refs, gouts)).backward()
    sum((o * g.abs()).sum() for o, g in zip(scales, gouts)).backward()
    (out.double() * gouts[r]).sum().backward()
    errs = []
    for got, want, scale in ((out, refs[r], scales[r]), (a.grad, leaves[r].grad, mags[r].grad),
                             (b.grad, leaves[w + r].grad, mags[w + r].grad)):
        if got is None or got.shape != want.shape or got.dtype != ex["dtype"]:
            return ("wrong", "shape/dtype", None if got is None else tuple(got.shape))
        errs.append(((got.double() - want).norm() / scale.norm().clamp_min(1e-30)).item()
                    if want.numel() else 0.0)
    return ("ok", max(errs) <= TOL[ex["dtype"]], max(errs))


def _hunt(rank: int, world: int, examples: int):
    groups = {"world": dist.group.WORLD, "sub": dist.new_group(list(range(1, world)))}
    outcomes = [(ex, _one(ex, rank, groups)) for ex in PINNED]

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(ex=EXAMPLE)
    def prop(ex):
        outcomes.append((ex, _one(ex, rank, groups)))

    prop()
    return outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_exact_or_the_same_clear_error(world):
    per_rank = run_local(_hunt, world, EXAMPLES, timeout=600, pg_timeout_s=30)
    assert len({len(o) for o in per_rank}) == 1, "ranks drew different numbers of examples"
    seen = set()
    for i, rows in enumerate(zip(*per_rank)):
        ex = rows[0][0]
        outs = [o for _, o in rows if o != ("skip",)]
        assert all(e == ex for e, _ in rows), f"example {i}: ranks drew different examples"
        kinds = {o[0] for o in outs}
        seen |= kinds
        assert kinds in ({"ok"}, {"error"}), f"example {i}: {ex} -> {outs}"
        if kinds == {"ok"}:
            assert all(o[1] for o in outs), (i, ex, outs)  # within tolerance
        else:
            assert len(set(outs)) == 1, (i, ex, outs)  # the same error on every rank
    assert seen == {"ok", "error"}, seen  # the examples reach both outcomes


LENGTHS = (8, 5, 13, 2, 8)  # tokens of successive steps; 2 leaves a rank empty at W=3


def _steps(rank: int, world: int):
    """Every op and method over a sequence length that changes from call to call."""
    groups = {"world": dist.group.WORLD}
    out = []
    for op in OPS:
        for variant in METHODS:
            for i, total in enumerate(LENGTHS):
                ex = dict(op=op, variant=variant, group="world", explicit=True, mid=2, k=3, n=2,
                          seq_dim=1, dtype=torch.float32, bad=None, seed=i,
                          sizes=list(commfuse.even_sizes(total, world)))
                out.append((op, variant[0], total, _one(ex, rank, groups)))
    return out


def test_sequence_length_changes_every_call():
    for rows in zip(*run_local(_steps, 3, timeout=300, pg_timeout_s=30)):
        assert all(r[3][:2] == ("ok", True) for r in rows), rows

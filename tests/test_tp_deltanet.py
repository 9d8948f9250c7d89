"""Gated DeltaNet mixers under `commfuse.tp.parallelize` (`commfuse.tp.mixers.deltanet`), beyond the
Qwen3.5 and Qwen3-Next families of tests/test_tp_families.py: the rows each rank owns in both
in_proj layouts (Qwen3.5's separate linears, Qwen3-Next's packed per key head) against the
model's own split, with no processes; what the plan refuses; and on 2 and 4 gloo ranks
Qwen3.5 under a padding mask (generation with a cache: tests/test_tp_generate.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from commfuse.tp.families import build
from test_tp_families import _check, _refused


def _parts(mixer, x):
    """The model's own q, k, v, z, b, a of input ``x`` (heads on dim -2; b, a ``[.., Hv]``)."""
    Hk, Hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    if hasattr(mixer, "in_proj_qkvz"):
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x),
                                                              mixer.in_proj_ba(x))
        return q, k, v, z, b, a
    q, k, v = mixer.in_proj_qkv(x).split([Hk * dk, Hk * dk, Hv * dv], -1)
    return (q.unflatten(-1, (Hk, dk)), k.unflatten(-1, (Hk, dk)), v.unflatten(-1, (Hv, dv)),
            mixer.in_proj_z(x).unflatten(-1, (Hv, dv)), mixer.in_proj_b(x), mixer.in_proj_a(x))


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_each_rank_gets_its_heads_rows(family, T):
    from commfuse.tp.attention import AssembledRows, unpack_rows
    from commfuse.tp.mixers.deltanet import deltanet_layout
    model = build(family)
    mixer = model.model.layers[0].linear_attn
    lay = deltanet_layout(mixer, T)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _parts(mixer, x)
        for r in range(T):
            ys = [x @ getattr(mixer, n).weight[lay.rows(p, r)].t() for n, p in lay.linears]
            got = torch.cat(ys, -1).split(lay.local_sizes(), -1)
            kh = list(range(r // lay.replicas * lay.local_k_heads,
                            (r // lay.replicas + 1) * lay.local_k_heads))
            vh = list(range(r * lay.local_v_heads, (r + 1) * lay.local_v_heads))
            for part, g, w in zip("qkvzba", got, want):
                w = w[..., kh, :] if part in "qk" else w[..., vh, :] if part in "vz" else w[..., vh]
                w = w.flatten(2) if part not in "ba" else w
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (part, r)  # GEMM rounding
            # conv1d: the q | k | v channels of the same heads, in the model's channel order
            Hk, dk, dv = mixer.num_k_heads, mixer.head_k_dim, mixer.head_v_dim
            qkv = [h * dk + i for h in kh for i in range(dk)]
            want_ch = qkv + [Hk * dk + c for c in qkv] + \
                [2 * Hk * dk + h * dv + i for h in vh for i in range(dv)]
            assert lay.conv_rows(r).tolist() == want_ch
    for name, parts in lay.linears:  # the assembled weight maps back to the model's
        w, rows = getattr(mixer, name).weight.detach(), lay.rows(parts)
        assert torch.equal(unpack_rows(AssembledRows(rows), w[rows], T), w)


def test_a_gated_deltanet_is_planned_as_a_whole():
    from commfuse.tp.mixers.deltanet import DeltaNetParallel
    from commfuse.tp.plan import derive_plan
    from commfuse.tp.sequence import SequenceParallelNorm
    from commfuse.tp.style import FusedRowwiseParallel
    styles = derive_plan(build("qwen3.5"), 4).styles
    where = "model.layers.0.linear_attn"
    assert isinstance(styles[where], DeltaNetParallel)
    assert isinstance(styles[where + ".out_proj"], FusedRowwiseParallel)
    assert isinstance(styles[where + ".norm"], SequenceParallelNorm)
    assert not any(n.startswith(where + ".in_proj") or n == where + ".conv1d" for n in styles)


def test_refuses_value_heads_that_do_not_divide():
    _refused(build("qwen3.5", linear_num_key_heads=2, linear_num_value_heads=6), 4,
             r"model\.layers\.0\.linear_attn: num_v_heads \(6\) must be divisible by the TP "
             r"size \(4\)")


def test_refuses_key_heads_that_neither_split_nor_replicate():
    _refused(build("qwen3.5", linear_num_key_heads=3, linear_num_value_heads=6), 2,
             r"model\.layers\.0\.linear_attn: num_k_heads \(3\) and the TP size \(2\) must "
             r"divide one another")


def test_refuses_a_mixer_with_parameters_it_does_not_know():
    model = build("qwen3.5")
    model.model.layers[1].linear_attn.extra = torch.nn.Parameter(torch.ones(3))
    _refused(model, 2, r"model\.layers\.1\.linear_attn \(Qwen3_5GatedDeltaNet\).*"
                       r"parameters \['extra'\]")


# --- on gloo ranks ---------------------------------------------------------------------------

def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    return {"qwen3.5-mask": _check("qwen3.5", "commfuse", mesh, mask=True, steps=0)}


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, timeout=600, pg_timeout_s=60)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["qwen3.5-mask"])
def test_on_ranks(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


def test_a_gated_norm_is_not_taken_for_an_rms_norm():
    from commfuse.tp.norms import rms_norm_like
    norm = build("qwen3.5").model.layers[0].linear_attn.norm
    assert not rms_norm_like(norm)  # its forward needs the gate: not called, no TypeError
    assert rms_norm_like(torch.nn.RMSNorm(8, eps=1e-6))


def test_refuses_a_projection_of_the_wrong_width():
    model = build("qwen3.5")
    model.model.layers[2].linear_attn.in_proj_z = torch.nn.Linear(32, 24, bias=False)
    _refused(model, 2, r"model\.layers\.2\.linear_attn \(Qwen3_5GatedDeltaNet\): a Gated "
                       r"DeltaNet mixer with in_proj_z of 24 rows \(want 32: z\)")

"""The deduplicated dispatch in the cost models: `commfuse.sim.routing.expected_ranks` (the
distinct destination ranks of a uniformly routed token) against a Monte-Carlo count of the
rows the real routing code moves (`commfuse.ops.moe.routing.marks`), the simulator's
tables (`counts_of`) marking the same rows as that code, `representative` keeping the
dedup's share, and the planner's MoE all-to-alls carrying one row per (token, rank). Pure:
no processes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from commfuse.ops.moe.routing import marks
from commfuse.sim.moe import counts_of, representative, route_tokens, routing_counts
from commfuse.sim.routing import expected_ranks
from commfuse.sim.step.arch import HybridConfig, MoESpec
from commfuse.sim.step.layers import moe_ops
from commfuse.sim.step.ops import wire_bytes


def _uniform(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    """[tokens, k]: k distinct experts per token, uniformly at random."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).argsort(-1)[:, :k]


@pytest.mark.parametrize("experts,world,k", [(16, 4, 4), (8, 2, 2), (128, 8, 8), (64, 8, 6)])
def test_expected_ranks_matches_the_rows_the_routing_moves(experts, world, k):
    tokens = 20000
    _, _, _, first, _, _ = marks(_uniform(tokens, experts, k, seed=experts + k), experts, world)
    per_token = first.sum().item() / tokens  # moved rows: one per (token, destination rank)
    want = expected_ranks(experts, world, k)
    sd = math.sqrt(world / 4 / tokens)  # a token's count has variance below W/4
    assert abs(per_token - want) < 5 * sd, (per_token, want)
    assert 1 <= want <= min(k, world)


def test_expected_ranks_edges():
    assert expected_ranks(16, 4, 1) == pytest.approx(1.0)  # one expert: one rank
    assert expected_ranks(16, 16, 4) == pytest.approx(4.0)  # one expert per rank: k ranks
    assert expected_ranks(8, 1, 2) == pytest.approx(1.0)
    # 16 experts top-4 over 4 ranks: 4 * (1 - C(12,4)/C(16,4)) = 4 * (1 - 495/1820)
    assert expected_ranks(16, 4, 4) == pytest.approx(4 * (1 - 495 / 1820))
    with pytest.raises(ValueError):
        expected_ranks(10, 4, 2)


@pytest.mark.parametrize("routing", ["balanced", "zipf"])
def test_counts_of_marks_the_rows_the_routing_code_marks(routing):
    experts, world, k = 16, 4, 4
    assignment = route_tokens(routing, 50, experts, k, world, seed=3)
    c = counts_of(assignment, experts, dedup=True)
    for p, mine in enumerate(assignment):
        e, _, _, first, last, _ = marks(torch.tensor(mine), experts, world)
        for table, mark in ((c.firsts, first), (c.lasts, last), (c.singles, first & last)):
            want = torch.zeros(experts, dtype=torch.long).index_add_(
                0, e[mark], torch.ones_like(e[mark]))
            assert list(table[p]) == want.tolist()
    assert c.dedup and sum(map(sum, c.pairs)) < sum(map(sum, c.tokens))


def test_representative_keeps_the_moved_share():
    c = routing_counts("zipf", 512, 16, 4, 4, seed=1, dedup=True)
    rep = representative(c)
    share = sum(map(sum, c.pairs)) / sum(map(sum, c.tokens))
    assert rep.dedup
    assert sum(map(sum, rep.pairs)) / sum(map(sum, rep.tokens)) == pytest.approx(share, abs=0.04)


def test_planner_moves_one_row_per_token_and_rank():
    moe = MoESpec(experts=16, top_k=4, expert_ffn=384)
    cfg = HybridConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=4, ffn_hidden=512,
                       max_seq_len=1024, moe=moe)
    ep, seq = 4, 512
    fwd, bwd = moe_ops(cfg, 1, 1, ep, ep, seq, 1)
    ops = [o for o in fwd + bwd if o.kind in ("a2a_matmul", "matmul_a2a")]
    assert len(ops) == 4
    remote = expected_ranks(16, ep, 4) * (ep - 1) / ep  # distinct remote ranks per token
    for o in ops:
        width = o.shape[1] if o.kind == "a2a_matmul" else o.shape[2]
        assert wire_bytes(o, ep, 2) == pytest.approx(seq * remote * width * 2)
    # the GEMMs still run one row per (token, expert)
    assert all(o.shape[0] == ep * seq * 4 for o in ops)
    plain = dataclasses.replace(ops[0], moved=1.0)
    assert wire_bytes(ops[0], ep, 2) < wire_bytes(plain, ep, 2)


def test_bench_counts_the_dedup_of_its_routing_table():
    from commfuse.bench.moe import MoEOptions, dedup_saving

    uniform = MoEOptions(16, 4, "zipf", zipf_s=0.0)  # popularity flat: uniform routing
    dd = dedup_saving(4, 4096, 512, 4, uniform)
    assert dd["rows"] < dd["rows_plain"] and dd["bytes"] == dd["rows"] * 2 * 512 * 4
    assert dd["saving"] == pytest.approx(dd["expected_saving"], abs=0.03)
    c = counts_of(uniform.assignment(4, 4096), 16, dedup=True)
    assert dd["rows"] == sum(c.pairs[p][q] for p in range(4) for q in range(4) if p != q)


def test_pool_takes_the_median_of_every_runs_paired_ratios():
    from commfuse.bench.pool import markdown, pool

    def run(none, auto):
        return [{"workload": "moe", "seq": 8, "pass": "forward+backward", "routing": "r",
                 "d_model": 4, "ffn": 4, "world": 4, "dedup": None,
                 "methods": [{"method": "none", "samples_ms": none, "median_ms": 0.0},
                             {"method": "auto", "samples_ms": auto, "median_ms": 0.0}]}]
    got = pool([run([10, 20, 10], [8, 10, 9]), run([10, 10, 10], [7, 7, 11])])
    (auto,) = [m for m in got[0]["methods"] if m["method"] == "auto"]
    assert auto["per_run"] == [0.8, 0.7]  # medians of 0.8, 0.5, 0.9 and 0.7, 0.7, 1.1
    assert auto["pooled"] == pytest.approx(0.75)  # of 0.5, 0.7, 0.7, 0.8, 0.9, 1.1
    assert "2 runs pooled" in markdown(got)

"""Query-split TP attention chosen by the cost model: the fused-attention time model, query-split
in the step model, `auto`'s choice (the same as the simulator's), and the choice's training
step exact against the unsharded model on 2 and 3 ranks."""

import dataclasses

import pytest
import torch

from commfuse import sim
from commfuse.models.llama import LlamaConfig
from commfuse.ops import auto
from commfuse.parallel.config import ParallelDims
from commfuse.sim.attention import attention_s, slot_attention_s
from commfuse.sim.costs import OpSpec
from commfuse.sim.step.ops import tp_attention_ops
from commfuse.sim.step.timing import OpTimer, query_split_wins, resolve_query_split, simulate_step
from commfuse.testbed.spawn import run_local

BASE = dict(gemm_flops=100e9, link_bandwidth=1e9, link_latency=1e-6, mem_bandwidth=1e12)
# a slow link beside slow attention: the out-projection's transfer is what query-split hides
SLOW = sim.Hardware(**{**BASE, "gemm_flops": 1e9, "link_bandwidth": 1e6},
                    attention_efficiency=(0.01, 0.01))
# a free link with a host cost per post: nothing to hide, and query-split posts more
FAST = sim.Hardware(**{**BASE, "gemm_flops": 1e9, "link_bandwidth": 1e12, "link_latency": 1e-9},
                    host_p2p_s=1e-3)
CFG = LlamaConfig(vocab_size=64, dim=256, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden=512,
                  max_seq_len=512)


def test_attention_time_rises_to_its_efficiency_with_length():
    hw = sim.Hardware(**BASE, attention_efficiency=(0.5, 0.4), attention_k0=100.0)
    flat = dataclasses.replace(hw, attention_k0=0.0)
    assert flat.attention_time(1e9, 10) == pytest.approx(1e9 / (100e9 * 0.5))
    assert flat.attention_time(1e9, 10, backward=True) == pytest.approx(1e9 / (100e9 * 0.4))
    assert hw.attention_time(1e9, 100) == pytest.approx(2 * flat.attention_time(1e9, 100))
    times = [hw.attention_time(1e9, k) for k in (10, 100, 1000, 10000)]
    assert times == sorted(times, reverse=True) and times[-1] < 1.02 * flat.attention_time(1e9, 1)


def test_attention_is_a_fused_kernel_where_the_hardware_has_its_efficiency():
    with_eff = sim.Hardware(**BASE, attention_efficiency=(0.5, 0.4))
    without = sim.Hardware(**BASE)
    keys = sum(range(1, 65))  # rows 0..63 see 1..64 keys
    assert attention_s(with_eff, range(64), 2, 16) == pytest.approx(
        4 * 2 * 16 * keys / (100e9 * 0.5))
    assert attention_s(with_eff, range(64), 2, 16, 2.5) == pytest.approx(
        2.5 * 4 * 2 * 16 * keys / (100e9 * 0.4))
    assert attention_s(without, range(64), 2, 16) == pytest.approx(
        2 * 2 * without.gemm_time(64, 16, keys / 64))


def test_a_batch_of_sequences_costs_batch_times_one_in_each_slot():
    one = OpSpec("matmul_rs", "commfuse", (64, 32, 32), attention=(16, "contiguous", 1.0))
    four = OpSpec("matmul_rs", "commfuse", (4 * 64, 32, 32), attention=(16, "contiguous", 1.0, 4))
    hw = sim.Hardware(**BASE, attention_efficiency=(0.5, 0.4))
    for slot in range(2):
        assert slot_attention_s(hw, four, 2, slot, 0, 0) == pytest.approx(
            4 * slot_attention_s(hw, one, 2, slot, 0, 0))


def test_the_step_model_runs_query_split_attention():
    f, b = tp_attention_ops(CFG, 2, 512, 4, True)
    assert [o.name for o in f] == ["attention+out-proj"] and f[0].attention[3] == 4
    assert [o.name for o in b] == ["out-proj+attention bwd"] and f[0].shape[0] == 4 * 512
    rows = {}
    for qs in (False, True):
        r = simulate_step(CFG, ParallelDims(2, method="commfuse", world_size=2, query_split=qs),
                          SLOW, seq=512, batch=4, micro_batch=4, dtype_bytes=4)
        rows[qs] = {row[0].name for row in r.rows}
    assert "attention+out-proj" in rows[True] and "out-proj" not in rows[True]
    assert "out-proj" in rows[False] and "attention+out-proj" not in rows[False]


@pytest.mark.parametrize("hw,wins", [(SLOW, True), (FAST, False)])
def test_auto_chooses_query_split_as_the_simulator_times_it(hw, wins):
    timer = OpTimer(4, 10e-6)
    assert query_split_wins(CFG, 2, 512, 4, "auto", {}, hw, timer) is wins
    auto_dims = ParallelDims(2, method="auto", world_size=2)  # query_split None: the model's
    assert resolve_query_split(auto_dims, CFG, 512, 4, 4, hw, timer) is wins
    for forced in (True, False):
        assert resolve_query_split(dataclasses.replace(auto_dims, query_split=forced), CFG, 512,
                                   4, 4, hw, timer) is forced
    fixed = ParallelDims(2, method="commfuse", world_size=2)  # fixed methods: row-parallel
    assert resolve_query_split(fixed, CFG, 512, 4, 4, hw, timer) is False
    try:
        auto.set_hardware(hw)
        like = torch.zeros(1)
        shape = (512, 4, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, CFG.dim)
        assert auto.choose_query_split(*shape, 2, like) is wins
        assert auto.choose_query_split(*shape, 1, like) is False
    finally:
        auto._HARDWARE.clear()
        auto.set_hardware(auto._hardware("cpu"))
        auto._HARDWARE.clear()


def test_the_planner_query_splits_only_where_the_runtime_does():
    """The runtime's auto query-splits only on CPU (`auto.choose_query_split`), so the planner's
    does not on a GPU model (NCCL's serial P2P), even where the simulator times it faster."""
    timer, auto_dims = OpTimer(4, 10e-6), ParallelDims(2, method="auto", world_size=2)
    gpu = dataclasses.replace(SLOW, serial_p2p=True)
    assert query_split_wins(CFG, 2, 512, 4, "auto", {}, gpu, timer)
    assert resolve_query_split(auto_dims, CFG, 512, 4, 4, gpu, timer) is False
    forced = dataclasses.replace(auto_dims, query_split=True)  # a what-if the planner still times
    assert resolve_query_split(forced, CFG, 512, 4, 4, gpu, timer) is True
    assert not auto.choose_query_split(512, 4, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, CFG.dim,
                                       2, torch.zeros(1, device="meta"))


def test_query_split_settings_are_checked():
    with pytest.raises(ValueError, match="query_split must be None, True or False"):
        ParallelDims(2, world_size=2, query_split="yes")
    from commfuse.train.config import TrainConfig
    with pytest.raises(ValueError, match="contradict"):
        TrainConfig(query_split=True, no_query_split=True)


def _chosen_and_exact(rank: int, world: int) -> tuple[list, dict]:
    """tp=world, method auto with query_split left to the model on SLOW (query-split wins):
    what TP attention ran, and the mismatches against the unsharded model."""
    import test_parallel as tp_tests  # the reference check of every parallel plan
    from commfuse.parallel import tensor

    auto.set_hardware(SLOW)
    ran = []
    real = tensor.query_split_attention
    tensor.query_split_attention = lambda *a, **k: ran.append(True) or real(*a, **k)
    try:
        variant = "tp3" if world == 3 else "f32"
        mesh = ParallelDims(tp=world).build_mesh()
        problems = tp_tests._check(mesh, "auto", {}, variant)
    finally:
        tensor.query_split_attention = real
    return ran, problems


@pytest.mark.parametrize("world", [2, 3])
def test_auto_query_split_training_step_matches_unsharded_model(world):
    for rank, (ran, problems) in enumerate(run_local(_chosen_and_exact, world, timeout=300,
                                                     pg_timeout_s=60)):
        assert ran, f"rank {rank}: auto ran row-parallel attention where query-split wins"
        assert not problems, (rank, problems)


def test_attention_cut_into_calls_costs_per_call():
    """`Hardware.attention_q0`: a call of n query rows runs at n / (n + q0); query-split's runs
    of consecutive rows are its calls (`attention_s` counts them)."""
    hw = sim.Hardware(**BASE, attention_efficiency=(0.5, 0.4))
    cut = dataclasses.replace(hw, attention_q0=32.0)
    assert cut.attention_time(1e9, 10, rows_per_call=32) == pytest.approx(
        2 * hw.attention_time(1e9, 10))
    one_run = list(range(64))
    four_runs = [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]  # the same rows
    assert attention_s(cut, one_run, 2, 16) == pytest.approx(
        attention_s(hw, one_run, 2, 16) * (64 + 32) / 64)
    # the same rows in four calls: (16 + 32) / 16 against (64 + 32) / 64 times the free rate
    assert attention_s(cut, four_runs, 2, 16) == pytest.approx(
        attention_s(hw, one_run, 2, 16) * (16 + 32) / 16)


def test_query_splits_m_is_chosen_with_its_attention_inside():
    """commfuse's m for query-split is chosen on the out-projection with each slot's attention
    (`auto.resolve(attention=...)`): on cpu-testbed, at S=4096 over 2 ranks, the attention
    hides the transfer with one slot per rank, where the out-projection alone would cut it in
    four; more calls cost attention efficiency (measured: 16 runs of 256 rows 1.10x one causal
    SDPA at S=4096, 4 runs 1.02x)."""
    from commfuse.ops.methods import method_spec

    like = torch.empty(0)
    auto.set_hardware("cpu-testbed")
    shape, attention = (4096, 256, 512), (64, "balanced", 1.0, 1)
    plain = auto.resolve(method_spec("commfuse", {}), "matmul_rs", shape, 2, like)
    inside = auto.resolve(method_spec("commfuse", {}), "matmul_rs", shape, 2, like,
                          attention=attention)
    assert (plain.splits, inside.splits) == (4, 1)
    chosen = auto.resolve(method_spec("auto", {}), "matmul_rs", shape, 2, like,
                          attention=attention)
    assert chosen.method == "commfuse" and chosen.splits == 1

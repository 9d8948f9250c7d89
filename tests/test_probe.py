"""The hardware model fitted at start (`commfuse.runtime.probe`, `commfuse.ops.auto.calibrate`):
the compute is scaled to a measured GEMM rate, the links are kept, and every rank of a group
ends with the same model (the slowest rank's rate), so auto's choices stay the same on all."""

import pytest
import torch

from commfuse.ops import auto
from commfuse.runtime import probe
from commfuse.sim.choose import best_splits
from commfuse.sim.hardware import preset
from commfuse.testbed.spawn import run_local
from commfuse.train.config import TrainConfig

SHAPE = probe.GEMM_SHAPE["cpu"]
B, H, S, D = probe.ATTENTION_SHAPE["cpu"]
ATTN = probe.attention_flops(B, H, S, D)


def _rate(hw, shape=SHAPE):
    m, k, n = shape
    return 2.0 * m * k * n / hw.gemm_time(m, k, n)


def _attention_rate(hw):
    return ATTN / hw.attention_time(ATTN, (S + 1) / 2, rows_per_call=S)


def test_fitted_to_its_own_rates_is_unchanged():
    hw = preset("cpu-testbed")
    fitted = probe.fit(hw, probe.Rates(_rate(hw), _attention_rate(hw)))
    assert fitted.gemm_flops == pytest.approx(hw.gemm_flops, rel=1e-12)
    assert fitted.attention_efficiency == pytest.approx(hw.attention_efficiency, rel=1e-12)


def test_fitted_model_predicts_the_measured_rates_and_keeps_the_rest():
    hw = preset("cpu-testbed")
    rates = probe.Rates(1.7 * _rate(hw), 1.4 * _attention_rate(hw))
    fast = probe.fit(hw, rates)
    assert _rate(fast) == pytest.approx(rates.gemm_flops)
    assert _attention_rate(fast) == pytest.approx(rates.attention_flops)
    for shape in ((64, 512, 768), (4096, 4096, 1024), (7, 3, 5)):  # one clock for all GEMMs
        assert fast.gemm_time(*shape) == pytest.approx(hw.gemm_time(*shape) / 1.7)
    # the backward's efficiency by the forward's factor, as a fraction of the new peak
    ratio = fast.attention_efficiency[1] / hw.attention_efficiency[1]
    assert ratio == pytest.approx(1.4 / 1.7)
    for name in ("link_bandwidth", "link_latency", "duplex_efficiency", "collective_efficiency",
                 "interference", "fifo_per_peer", "host_collective_s", "mem_bandwidth",
                 "m0", "n0", "k0", "attention_k0", "attention_q0"):
        assert getattr(fast, name) == getattr(hw, name), name


SMALL = probe.SMALL_GEMM_SHAPE["cpu"]


def test_two_gemms_fit_the_peak_and_the_row_overhead():
    hw = preset("cpu-testbed")
    same = probe.fit(hw, probe.Rates(_rate(hw), None, _rate(hw, SMALL)))
    assert same.m0 == pytest.approx(hw.m0) and same.gemm_flops == pytest.approx(hw.gemm_flops)
    # a machine 1.6x as fast on the large GEMM whose 128-row GEMM runs at 0.75 of that
    rates = probe.Rates(1.6 * _rate(hw), None, 0.75 * 1.6 * _rate(hw))
    fast = probe.fit(hw, rates)
    assert _rate(fast) == pytest.approx(rates.gemm_flops)
    assert _rate(fast, SMALL) == pytest.approx(rates.small_gemm_flops)
    assert fast.m0 > 4 * hw.m0  # rows cost more than the preset says
    assert (fast.n0, fast.k0) == (hw.n0, hw.k0)
    # a small GEMM as fast as the large one: no row overhead, the peak fitted to the large one
    flat = probe.fit(hw, probe.Rates(1e11, None, 1.1e11))
    assert flat.m0 == 0.0 and _rate(flat) == pytest.approx(1e11)
    with pytest.raises(ValueError, match="small_gemm_flops"):
        probe.fit(hw, probe.Rates(1e11, None, 1e10))  # slower per row than the whole
    with pytest.raises(ValueError, match="small_gemm_flops must be > 0"):
        probe.fit(hw, probe.Rates(1e11, None, -1.0))


NARROW = probe.NARROW_SHAPES["cpu"]


def test_narrow_gemms_run_in_their_own_regime_fitted_to_two_sizes_of_b():
    hw = preset("cpu-testbed")
    assert hw.narrow_rows and SMALL[0] >= hw.narrow_rows > NARROW[0][0]
    wide = hw.with_(narrow_rows=0.0)
    # 128 rows run at a step below the wide formula, not on its curve
    assert _rate(hw, NARROW[0]) < 0.75 * _rate(wide, NARROW[0])
    assert _rate(hw, SMALL) == _rate(wide, SMALL)
    rates = probe.Rates(_rate(hw), None, _rate(hw, SMALL),
                        narrow_flops=(0.6 * _rate(hw), 0.5 * _rate(hw)))
    fitted = probe.fit(hw, rates)
    for r, shape in zip(rates.narrow_flops, NARROW):
        assert _rate(fitted, shape) == pytest.approx(r)
    assert fitted.narrow_decay > hw.narrow_decay  # the larger B slower than the preset says
    assert (fitted.gemm_flops, fitted.m0) == pytest.approx((hw.gemm_flops, hw.m0))
    # a narrow GEMM with a B smaller than the probe's is no faster than the wide formula,
    # and runs at the regime's rate at the probe's B (its decay is not extrapolated upwards:
    # 128-row pieces at K = N = 1024 ran 1.14-1.46x the time of the whole GEMM here)
    assert _rate(fitted, (128, 64, 64)) <= _rate(fitted.with_(narrow_rows=0.0), (128, 64, 64))
    factor = lambda shape: _rate(fitted, shape) / _rate(fitted.with_(narrow_rows=0.0), shape)
    assert factor((128, 1024, 1024)) == pytest.approx(factor(NARROW[0]))
    # no narrow regime in the model: the narrow rates leave it without one
    plain = probe.fit(wide, rates)
    assert (plain.narrow_efficiency, plain.narrow_decay) == (wide.narrow_efficiency,
                                                             wide.narrow_decay)
    with pytest.raises(ValueError, match="narrow_efficiency"):
        hw.with_(narrow_efficiency=0.0)


def test_attention_is_left_alone_where_the_model_times_it_as_gemms():
    hw = preset("cpu-testbed").with_(attention_efficiency=(0.0, 0.0))
    assert probe.fit(hw, probe.Rates(1e11, 5e10)).attention_efficiency == (0.0, 0.0)
    assert probe.fit(preset("cpu-testbed"), probe.Rates(1e11, None)).attention_efficiency \
        == preset("cpu-testbed").attention_efficiency


def test_an_efficiency_never_exceeds_one():
    hw = preset("cpu-testbed")
    assert max(probe.fit(hw, probe.Rates(_rate(hw), 10 * _attention_rate(hw)))
               .attention_efficiency) == 1.0


def test_bad_rates_raise():
    with pytest.raises(ValueError, match="gemm_flops must be > 0"):
        probe.fit(preset("cpu-testbed"), probe.Rates(0.0, None))


def test_measured_rates_are_rates_of_this_machine():
    rates = probe.measure("cpu", torch.float32, repeats=2)
    assert 1e8 < rates.gemm_flops < 1e13  # a core of any CPU this runs on, flop/s
    assert 1e8 < rates.attention_flops < 1e13
    assert 1e8 < rates.small_gemm_flops < 1e13
    assert rates.narrow_flops is None
    assert rates.spread >= 1.0  # the second-slowest round over the fastest
    narrow = probe.measure("cpu", torch.float32, attention=False, repeats=1, narrow=True)
    assert len(narrow.narrow_flops) == 2 and all(1e8 < r < 1e13 for r in narrow.narrow_flops)
    assert probe.measure("cpu", torch.float32, attention=False, repeats=1).attention_flops is None


def test_calibrate_alone_sets_the_model_that_choices_are_made_on():
    like = torch.empty(0)
    hw, rates = auto.calibrate(like)
    assert auto._hardware("cpu") is hw
    assert _rate(hw) == pytest.approx(rates.gemm_flops, rel=1e-9)
    if max(hw.attention_efficiency) < 1.0:
        assert _attention_rate(hw) == pytest.approx(rates.attention_flops, rel=1e-9)
    else:  # attention measured faster than the GEMM peak allows: the fit caps it at 1.0
        assert _attention_rate(hw) <= rates.attention_flops * (1 + 1e-9)
    if hw.m0 > 0:  # (m0 >= 0: a small GEMM measured as fast per row, or faster, gives 0)
        assert _rate(hw, SMALL) == pytest.approx(rates.small_gemm_flops, rel=1e-9)
    else:
        assert _rate(hw, SMALL) <= rates.small_gemm_flops * (1 + 1e-9)
    # (a narrow regime never faster than the wide formula: with more threads it can be)
    assert _rate(hw, NARROW[0]) == pytest.approx(min(
        rates.narrow_flops[0], _rate(hw.with_(narrow_rows=0.0), NARROW[0])), rel=1e-9)
    shape = (4096, 512, 768)
    assert auto.choose_splits("ag_matmul", shape, 2, like) == \
        best_splits("ag_matmul", shape, 2, 4, hw, 50e-6, "ring")


def test_the_slowdown_beside_transfers_sets_the_models_interference():
    hw = preset("cpu-testbed")
    rates = probe.Rates(_rate(hw), _attention_rate(hw), _rate(hw, SMALL), 0.42)
    assert probe.fit(hw, rates).interference == 0.42
    assert probe.fit(hw, probe.Rates(_rate(hw), None, None, -0.03)).interference == 0.0
    assert probe.fit(hw, probe.Rates(_rate(hw), None)).interference == hw.interference
    assert "0.42 slower beside transfers" in rates.line()


def _slowdown(rank, world):
    return (probe.transfer_slowdown(preset("cpu-testbed").with_(link_bandwidth=2e9)),
            probe.post_cost())


def test_the_slowdown_and_the_post_cost_are_timed_over_a_real_exchange():
    # 2 GB/s at the model's rate: ~120 messages of 4 MiB each way over loopback, so GEMMs run
    # beside them; then small batches posted through the ops' transport, each waited; one
    # process alone has no one to exchange with
    out = run_local(_slowdown, 2, timeout=120)
    assert all(isinstance(x, float) and x > -0.5 for x, _ in out), out
    assert all(isinstance(p, float) and 0 < p < 0.1 for _, p in out), out
    assert probe.transfer_slowdown(preset("cpu-testbed")) is None
    assert probe.post_cost() is None


def _calibrated(rank, world, rates, slowdowns=(None, None, None), posts=(None, None, None)):
    probe.measure = lambda *a, **k: rates[rank]  # this rank's "measurement"
    probe.transfer_slowdown = lambda *a, **k: slowdowns[rank]
    probe.post_cost = lambda *a, **k: posts[rank]
    hw, got = auto.calibrate(torch.empty(0))
    return got, hw, auto.choose_splits("ag_matmul", (4096, 512, 768), world, torch.empty(0))


@pytest.mark.parametrize("world", (2, 3))
def test_every_rank_ends_with_the_slowest_ranks_model(world):
    rates = [probe.Rates(1.5e11, 7.0e10, 1.1e11, narrow_flops=(6e10, 5e10)),
             probe.Rates(0.9e11, 8.0e10, 0.8e11, narrow_flops=(7e10, 4e10)),
             probe.Rates(1.2e11, 6.5e10, 0.7e11, narrow_flops=(5e10, 6e10))][:world]
    out = run_local(_calibrated, world, rates, timeout=120)
    assert all(o == out[0] for o in out), out  # the same rates, model and choice on every rank
    slowest = out[0][0]
    # every rate from rank 1, whose large GEMM is the slowest, not each rate's minimum
    assert slowest.gemm_flops == 0.9e11
    assert slowest.attention_flops == 8.0e10
    assert slowest.small_gemm_flops == 0.8e11
    assert slowest.narrow_flops == (7e10, 4e10)
    assert slowest.interference is None and out[0][1].interference == \
        preset("cpu-testbed").interference  # not timed anywhere: the preset's
    out = run_local(_calibrated, world, rates, (0.2, 0.47, None)[:world],
                    (2e-5, 7e-5, None)[:world], timeout=120)
    assert all(o == out[0] for o in out), out
    assert out[0][0].interference == out[0][1].interference == 0.47  # the largest
    assert out[0][0].post_s == out[0][1].host_p2p_s == 7e-5  # the largest host time per post
    assert "70 us per post" in out[0][0].line()
    out = run_local(_calibrated, world, rates, (-0.05, None, None)[:world], timeout=120)
    assert out[0][0].interference == -0.05 and out[0][1].interference == 0.0  # timed, clamped
    assert out[0][0].post_s is None and out[0][1].host_p2p_s == preset("cpu-testbed").host_p2p_s


def _calibrated_in_turn(rank, world, attempts):
    turns = iter(attempts[rank])
    probe.measure = lambda *a, **k: next(turns)  # this rank's measurements, one per call
    probe.transfer_slowdown = lambda *a, **k: None
    return auto.calibrate(torch.empty(0))[1], next(turns, None)  # (and the first not taken)


def _r(gemm, spread):
    return probe.Rates(gemm, None, 0.8 * gemm, spread=spread)


def test_a_noisy_probe_is_measured_again_and_the_least_spread_attempt_kept(monkeypatch):
    # rank 1's rounds spread 1.6x at first: every rank measures again, once
    out = run_local(_calibrated_in_turn, 2, [[_r(1.5e11, 1.05), _r(1.4e11, 1.02), _r(9e10, 1)],
                                             [_r(1.4e11, 1.6), _r(1.45e11, 1.1), _r(9e10, 1)]],
                    timeout=120)
    for got, first_not_taken in out:
        assert (got.attempts, got.spread, got.gemm_flops) == (2, 1.1, 1.4e11)
        assert first_not_taken.gemm_flops == 9e10
    assert "spread 1.10x (best of 2 probes)" in out[0][0].line()
    # the ranks' rates 1.5, 1.30 and 1.36x apart: three attempts, the second kept
    out = run_local(_calibrated_in_turn, 2, [[_r(1.5e11, 1.0)] * 3,
                                             [_r(1e11, 1.0), _r(1.15e11, 1.1), _r(1.1e11, 1.0)]],
                    timeout=120)
    assert all(o[0] == out[0][0] for o in out)
    assert (out[0][0].attempts, out[0][0].spread, out[0][0].gemm_flops) == (3, 1.3, 1.15e11)
    # one process: its own rounds alone; a quiet first probe is the only one
    turns = iter([_r(1.2e11, 1.4), _r(1e11, 1.3), _r(1.1e11, 1.35)])
    monkeypatch.setattr(probe, "measure", lambda *a, **k: next(turns))
    got = probe.probe(preset("cpu-testbed"))[1]
    assert (got.attempts, got.spread, got.gemm_flops) == (3, 1.3, 1e11)
    monkeypatch.setattr(probe, "measure", lambda *a, **k: _r(1.2e11, 1.2))
    assert probe.probe(preset("cpu-testbed"))[1].attempts == 1


def test_a_preset_by_name_and_its_log_line():
    like = torch.empty(0)
    hw, line = auto.use_hardware("h100-nvlink", like)
    assert hw == preset("h100-nvlink") and "h100-nvlink preset" in line
    hw, line = auto.use_hardware("measured", like)
    assert "measured here" in line and auto._hardware("cpu") is hw


def test_the_flag_takes_measured_or_a_preset():
    assert TrainConfig().hardware == "measured"
    TrainConfig(hardware="cpu-testbed")
    with pytest.raises(ValueError, match="hardware must be one of"):
        TrainConfig(hardware="a-laptop")


def test_a_runs_fitted_fields_round_trip_through_json():
    import json

    hw = preset("cpu-testbed")
    fast = probe.fit(hw, probe.Rates(1.6 * _rate(hw), 1.3 * _attention_rate(hw),
                                     1.2 * _rate(hw, SMALL)))
    meta = json.loads(json.dumps({"title": "a run", **probe.fitted_fields(fast)}))
    assert probe.from_fields(meta, hw) == fast
    assert probe.from_fields({"gemm_flops": 1e11}, hw) == hw.with_(gemm_flops=1e11)  # older file


def test_rounds_run_each_kernels_runs_back_to_back_in_a_rotated_order():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    out = probe._rounds(fns, torch.device("cpu"), 2, {"a": 2, "b": 1})
    assert calls == list("aaabb" "bbaaa")  # a warm-up, then the timed runs; order rotated
    assert {name: len(t) for name, t in out.items()} == {"a": 2, "b": 2}  # a median per round


def test_a_slow_round_moves_no_ratio_between_kernels():
    # the small kernel takes 1.25x the large one's time per flop in every round; in the
    # second of three rounds everything runs at a third of the speed
    flops = {"gemm": 4e9, "small": 1e9}
    times = {"gemm": [0.04, 0.12, 0.04], "small": [0.0125, 0.0375, 0.0125]}
    rates = probe._paired_rates(times, flops, "gemm")
    assert rates["gemm"] == pytest.approx(1e11)
    assert rates["small"] == pytest.approx(0.8e11)
    # with the slow spell on the small kernel's runs alone, its ratio is the fast rounds'
    times["small"] = [0.0125, 0.0125, 0.0375]
    assert probe._paired_rates(times, flops, "gemm")["small"] == pytest.approx(0.8e11)

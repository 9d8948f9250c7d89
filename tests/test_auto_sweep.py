"""scripts/auto_sweep.py's comparisons of auto with the best fixed method, on made-up
samples: the paired ratio and the held-out one (docs/benchmarks/simulator.md)."""

import json

import pytest

from script_module import load

auto_sweep = load("auto_sweep")


def _row(*samples):
    return {"samples_ms": list(samples)}


def test_paired_ratio_follows_a_slow_spell_that_slows_both():
    # auto 2 % slower in every iteration; iterations 3 and 4 at half speed for both
    best = _row(100, 100, 200, 200, 100)
    auto = _row(102, 102, 204, 204, 102)
    assert auto_sweep._paired(auto, best) == pytest.approx(1.02)
    assert auto_sweep._paired({"median_ms": 1.0}, best) is None  # a file without samples


def test_held_out_ratio_does_not_choose_on_the_samples_it_compares():
    # a: fast on even iterations, slow on odd; b steady. Chosen on the even ones, a is
    # compared on the odd ones (auto 110 / 120); chosen on the odd ones, b on the even
    # ones (110 / 105); the mean of the two
    med = {"a": _row(100, 120, 100, 120), "b": _row(105, 105, 105, 105),
           "auto": _row(110, 110, 110, 110)}
    assert auto_sweep._held_out(med, ["a", "b"]) == pytest.approx((110 / 120 + 110 / 105) / 2)
    assert auto_sweep._held_out({m: _row(1, 2, 3) for m in med}, ["a", "b"]) is None  # < 4


def test_held_out_fraction_of_the_limit_is_measured_where_it_was_not_chosen():
    # none 200 ms, the limit 100: a saves 100 ms on even iterations (of the limit 1.0) and
    # 70 on odd ones (0.7); b 90 on both (0.9); auto 92 (0.92). Chosen on the even ones, a
    # reaches 0.7 on the odd ones; chosen on the odd ones, b 0.9 on the even ones
    med = {"none": _row(200, 200, 200, 200), "a": _row(100, 130, 100, 130),
           "b": _row(110, 110, 110, 110), "auto": _row(108, 108, 108, 108)}
    auto, best = auto_sweep._held_out_limit(med, ["none", "a", "b"], 100.0)
    assert auto == pytest.approx(0.92) and best == pytest.approx((0.7 + 0.9) / 2)
    assert auto_sweep._held_out_limit({m: _row(1, 2, 3) for m in med}, ["a", "b"], 1.0) is None


def _made_up(tmp_path, run_hw, auto_scale: float = 1.0):
    """A bench file whose every method measured what the model predicts on ``run_hw`` (auto
    ``auto_scale`` times its pick's prediction), fitted to the ``cpu-testbed`` preset."""
    from commfuse.sim.hardware import preset
    from commfuse.runtime.probe import fitted_fields

    r = {"workload": "ag_matmul", "seq": 2048, "d_model": 1024, "ffn": 4096, "world": 2,
         "dtype": "float32", "pass": "forward", "comm_alone_ms": 1.0, "limit_ms": 1.0}
    shape = auto_sweep.op_shape(r)
    pick = auto_sweep._fastest(r, shape, run_hw)
    r["methods"] = []
    for m in auto_sweep.METHODS:
        sim = auto_sweep._predict(r, shape, run_hw, m, pick)
        ms = 1e3 * sim.total_s * (auto_scale if m == "auto" else 1.0)
        r["methods"].append({"method": m, "median_ms": ms, "p10_ms": ms, "p90_ms": ms,
                             "compute_ms": 1e3 * sim.compute_s})
    path = tmp_path / "op-2r.json"
    path.write_text(json.dumps({"meta": fitted_fields(preset("cpu-testbed")), "results": [r]}))
    return path


def test_one_schedule_measured_twice_is_auto_over_its_pick_run_as_the_fixed_method(tmp_path):
    # auto ran its pick's schedule and measured 6 % slower than that fixed method did
    from commfuse.sim.hardware import preset

    path = _made_up(tmp_path, preset("cpu-testbed"), auto_scale=1.06)
    (cell,) = auto_sweep.cells([path], "measured")
    assert cell["same"] == pytest.approx(1.06)
    assert "1.060-1.060, beyond 5 % in 1 of 1 cells" in auto_sweep.markdown([cell])


def test_run_rate_separates_a_slower_machine_from_the_model(tmp_path):
    # a made-up result measured exactly as the model predicts on a machine whose GEMMs run
    # at 0.8 of the probe's rate: on the probe's rate the simulator is off by about 25 %;
    # at the run's rate, found from compute alone, it is exact
    from commfuse.sim.hardware import preset

    probe_hw = preset("cpu-testbed")
    path = _made_up(tmp_path, probe_hw.with_(gemm_flops=0.8 * probe_hw.gemm_flops))
    row = auto_sweep.at_run_rate([path], "measured").split("\n")[2].split("|")
    drift, on_probe, at_run = float(row[5]), float(row[6][:-2]), float(row[7][:-2])
    assert drift == pytest.approx(0.8, abs=0.01)
    assert on_probe >= 15 and at_run <= 1


def test_auto_default_pools_runs_and_pairs_auto_with_the_default(tmp_path):
    # two runs of one workload: auto 5 % slower than the default in run 1's iterations and
    # 1 % faster in run 2's, run 2 at half speed; pooled, the paired ratio is the median of
    # all iterations' ratios (not of the runs' medians), and auto's pick and the default's m
    # are each run's model's
    from commfuse.runtime.probe import fitted_fields
    from commfuse.sim import choose
    from commfuse.sim.hardware import preset

    auto_default = load("auto_default")
    hw = preset("cpu-testbed")
    paths = []
    for run, (scale, auto) in enumerate(((1.0, 1.05), (2.0, 0.99))):
        base = [100 * scale, 110 * scale, 105 * scale]
        methods = [{"method": m, "samples_ms": [x * f for x in base], "compute_ms": 50.0}
                   for m, f in (("none", 2.0), ("commfuse", 1.0), ("auto", auto),
                                ("decompose", 1.1))]
        r = {"workload": "ag_matmul", "seq": 2048, "d_model": 1024, "ffn": 2048, "world": 2,
             "dtype": "float32", "pass": "forward", "comm_alone_ms": 40.0,
             "limit_ms": 90.0 * scale, "methods": methods, "fitted": fitted_fields(hw)}
        paths.append(tmp_path / f"run{run}.json")
        paths[-1].write_text(json.dumps({"results": [r]}))
    (c,) = auto_default.cells(paths)
    assert (c["op"], c["S"], c["K"], c["N"], c["runs"]) == ("ag_matmul", 2048, 1024, 1024, 2)
    assert c["paired"] == pytest.approx((1.05 + 0.99) / 2)  # the median of 6 ratios
    assert (c["p10"], c["p90"]) == pytest.approx((0.99, 1.05))
    args = ("ag_matmul", (2048, 1024, 1024), 2, 4, hw, choose.STEP_OVERHEAD_S["cpu"])
    assert c["default_m"] == [choose.best_splits(*args)] * 2
    assert c["auto_ran"] == [auto_default._label(*choose.choice(*args)[:2])] * 2
    assert c["best"] == "decompose" and c["pooled"]["none"] == pytest.approx((220 + 400) / 2)
    assert "| ag_matmul | 2048 | 1024 | 1024 |" in auto_default.markdown([c])

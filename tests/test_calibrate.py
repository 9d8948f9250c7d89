"""Calibration recovers a known hardware model from results the simulator itself produced."""

from dataclasses import replace

import pytest

from commfuse.sim import calibrate as cal
from commfuse.sim.hardware import preset


def _fake_bench(hw, seq=2048, d=1024, world=2):
    """Bench-shaped results whose 'measurements' are the simulator's predictions on ``hw``."""
    results = []
    for op in ("ag_matmul", "matmul_rs", "matmul_a2a", "a2a_matmul"):
        r = {"workload": op, "seq": seq, "d_model": d, "world": world, "dtype": "float32",
             "pass": "forward"}
        methods = []
        for label in cal.VARIANTS:
            s = cal._simulate(r, label, hw)
            methods.append({"method": label, "median_ms": 1e3 * s.total_s,
                            "compute_ms": 1e3 * s.compute_s})
        none = cal._simulate(r, "none", hw)
        results.append({**r, "methods": methods,
                        "comm_alone_ms": 1e3 * (none.total_s - none.compute_s)})
    return results


def test_calibration_recovers_flops_and_bandwidth():
    truth = replace(preset("cpu-testbed"), gemm_flops=90e9, link_bandwidth=2e9 / 8)
    hw = cal.calibrate(_fake_bench(truth), "cpu-testbed")
    assert hw.gemm_flops == pytest.approx(truth.gemm_flops, rel=0.02)
    assert hw.link_bandwidth == pytest.approx(truth.link_bandwidth, rel=0.05)
    rows = cal.compare(_fake_bench(truth, seq=4096), hw)  # a separate "run", another size
    assert max(abs(r["error"]) for r in rows) < 0.05
    assert "within 15 %" in cal.markdown(rows, hw)


def test_calibration_needs_forward_op_results():
    with pytest.raises(ValueError, match="forward op results"):
        cal.calibrate([{"workload": "mlp", "pass": "forward"}])

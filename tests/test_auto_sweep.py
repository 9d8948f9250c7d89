"""scripts/auto_sweep.py's comparisons of auto with the best fixed method, on made-up
samples: the paired ratio and the held-out one (docs/sim-vs-measured.md, "A noisy machine")."""

import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "auto_sweep", os.path.join(os.path.dirname(__file__), "..", "scripts", "auto_sweep.py"))
auto_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(auto_sweep)


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

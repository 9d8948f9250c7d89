"""scripts/qsplit_compute.py: one cell run in a group of one, its markdown row, its --pass."""

import argparse

import pytest
import torch.distributed as dist

from script_module import load

qsplit_compute = load("qsplit_compute")


def test_a_cell_times_both_layers_and_its_row_reads_back(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        r = qsplit_compute.cell(256, 128, True, iters=3, warmup=1, method="commfuse")
    finally:
        dist.destroy_process_group()
    assert r["row"] > 0 and r["qs"] > 0 and r["lo"] <= r["qs"] / r["row"] * 1.0001
    assert r["hi"] >= r["lo"] and all(f >= 0 for f in r["faults"])
    cells = qsplit_compute.row(128, 256, True, r).strip("|").split("|")
    assert [c.strip() for c in cells[:3]] == ["128", "256", "forward+backward"]
    assert float(cells[5]) == pytest.approx(r["qs"] / r["row"], abs=1e-3)
    assert len(cells) == qsplit_compute.HEADER.split("\n")[0].count("|") - 1


def test_pass_takes_forward_and_both_only():
    assert qsplit_compute._passes("forward,both") == [False, True]
    with pytest.raises(argparse.ArgumentTypeError, match="forward"):
        qsplit_compute._passes("backward")

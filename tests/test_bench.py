"""The benchmark machinery on 2 loopback ranks at tiny sizes: structure, not speed.

Speed is measured by `commfuse bench` on the emulated cluster (docs/benchmarks), never
asserted here.
"""

import functools
import json

import pytest
import torch

from commfuse.bench import measure, report
from commfuse.testbed.spawn import run_local


WORKLOADS = [("ag_matmul", True), ("matmul_rs", False), ("matmul_a2a", True),
             ("a2a_matmul", True), ("mlp", True), ("attn_row", False), ("attn_qsplit", True),
             ("ulysses", True)]


def _measure_all(rank, world):
    return {name: measure.measure(name, 32, 128, torch.float32, backward, iters=2, warmup=1,
                                  variants=list(measure.VARIANTS), trace=True,
                                  say=lambda m: None) for name, backward in WORKLOADS}


@functools.lru_cache(maxsize=None)
def _measured() -> dict:
    """Every workload measured on one pair of ranks (one start, as `commfuse bench` runs)."""
    return run_local(_measure_all, 2, timeout=600)[0]


@pytest.mark.parametrize("name,backward", WORKLOADS)
def test_measure_reports_every_method_and_a_trace(tmp_path, name, backward):
    r = _measured()[name]
    assert [m["method"] for m in r["methods"]] == list(measure.VARIANTS)
    for m in r["methods"]:
        assert m["p10_ms"] <= m["median_ms"] <= m["p90_ms"]
        assert m["compute_ms"] > 0 and m["exposed_ms"] == pytest.approx(m["median_ms"] - m["compute_ms"])
        assert len(m["samples_ms"]) == 2  # one per iteration, the median of them reported
        assert sorted(m["samples_ms"])[0] <= m["median_ms"] <= sorted(m["samples_ms"])[1]
    assert r["methods"][0]["vs_none"] == 1.0
    assert r["limit_ms"] > 0 and r["comm_alone_ms"] > 0
    paths = report.save([r], {"title": "test"}, str(tmp_path), "t")
    trace = json.load(open([p for p in paths if p.endswith(".trace.json")][0]))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["name"] for e in spans} >= set(measure.VARIANTS)  # one step span per method
    assert any(e["name"].endswith("compute 0") for e in spans)
    assert "commfuse" in report.table(r)


def test_ffn_sets_the_mlp_width_of_the_pair():
    """``--ffn F``: AG->GEMM is [S, D] @ [D, F/W] and GEMM->RS [S, F/W] @ [F/W, D]; the
    default stays 4D, and the simulator reads the same shapes back from a result."""
    from commfuse.ops import registry
    from commfuse.sim.calibrate import op_shape

    assert registry.layer_shapes("ag_matmul", 2, 64, 16, 24) == ((32, 16), (16, 12))
    assert registry.layer_shapes("matmul_rs", 2, 64, 16, 24) == ((64, 12), (12, 16))
    assert registry.layer_shapes("ag_matmul", 2, 64, 16) == ((32, 16), (16, 32))
    r = {"seq": 64, "d_model": 16, "world": 2, "workload": "matmul_rs", "ffn": 24}
    assert op_shape(r) == (64, 12, 16)
    assert op_shape({**r, "ffn": None}) == (64, 32, 16)


def test_measure_with_ffn(tmp_path):
    r = run_local(_measure_ffn, 2, timeout=300)[0]
    assert r["ffn"] == 96 and r["d_model"] == 128
    assert "ffn 96" in report.table(r)


def _measure_ffn(rank, world):
    return measure.measure("ag_matmul", 32, 128, torch.float32, False, iters=1, warmup=0,
                           variants=["none", "commfuse-m2"], trace=False, say=lambda m: None,
                           ffn=96)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_rank(rank, world, port, argv):
    """``commfuse bench ARGV`` as a rank that `commfuse launch` started runs it (RANK and the
    rendezvous in the environment), with the probe of tests/probe_small.py."""
    import os

    import torch.distributed as dist

    import probe_small
    from commfuse import cli

    dist.destroy_process_group()  # a launched rank starts with none: the command makes its own
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    probe_small.shrink()
    return cli.main(argv)


def test_probe_each_fits_the_model_again_before_every_workload(tmp_path, capfd, command):
    # two workloads on 2 ranks: a fit at start and one more, the same on every rank (a
    # rank that probed alone would hang the collective), each result with its own fit
    argv = ["bench", "op", "--nproc", "2", "--workloads", "ag_matmul", "--seq", "64,128",
            "--d-model", "64", "--pass", "forward", "--iters", "1", "--warmup", "0",
            "--methods", "none,auto", "--probe-each", "--no-trace", "--out", str(tmp_path)]
    capfd.readouterr()
    assert run_local(_bench_rank, 2, _free_port(), argv, timeout=300) == [0, 0]
    out = capfd.readouterr().out
    assert out.count("[bench] hardware model:") == 2
    results = json.load(open(tmp_path / "op-2r.json"))["results"]
    assert [r["seq"] for r in results] == [64, 128]
    preset = command("bench", "op", "--probe-each", "--hardware", "cpu-testbed")
    assert "--probe-each" in str(preset.returncode)  # SystemExit's message: a failed exit
    for r in results:
        assert r["hardware"].startswith("hardware model:") and r["fitted"]["gemm_flops"] > 0


def test_interleave_workloads_times_the_workloads_of_a_size_in_the_same_iterations(
        tmp_path, command, monkeypatch):
    # `--interleave-workloads`: one group per size and pass, each workload's result as
    # `measure` gives it, a forward-only workload dropped from the backward pass only; the
    # command launches its ranks as the installed one does (they read its argv)
    argv = ["bench", "layer", "--nproc", "2", "--workloads", "attn_row,attn_qsplit",
            "--seq", "32,64", "--d-model", "128", "--pass", "both", "--iters", "2",
            "--warmup", "0", "--methods", "none,commfuse", "--interleave-workloads",
            "--no-trace", "--hardware", "cpu-testbed", "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", ["commfuse", *argv])
    out = command(*argv)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("[bench] attn_row+attn_qsplit seq ") == 4
    results = json.load(open(tmp_path / "layer-2r.json"))["results"]
    assert [(r["workload"], r["seq"], r["pass"]) for r in results] == [
        (w, s, p) for s in (32, 64) for p in ("forward", "forward+backward")
        for w in ("attn_row", "attn_qsplit")]
    for r in results:
        assert [m["method"] for m in r["methods"]] == ["none", "commfuse"]
        assert all(len(m["samples_ms"]) == 2 and m["compute_ms"] > 0 for m in r["methods"])
        assert r["limit_ms"] > 0 and r["comm_alone_ms"] > 0


def test_measure_together_keeps_each_workload_apart():
    got = run_local(_measure_pair, 2, timeout=300)
    assert got[1] is None  # results on rank 0 only
    row, mlp = got[0]
    assert (row["workload"], mlp["workload"]) == ("attn_row", "mlp")
    assert mlp["ffn"] == 512
    for r in (row, mlp):
        assert all(len(m["samples_ms"]) == 2 for m in r["methods"])  # its own, not the pair's
        assert {s.label for s in r["spans"] if s.track == "step"} == {"none", "commfuse"}


def _measure_pair(rank, world):
    return measure.measure_together(["attn_row", "mlp"], 32, 128, torch.float32, False,
                                    iters=2, warmup=0, variants=["none", "commfuse"],
                                    trace=True, say=lambda m: None)

"""`commfuse bench train`: configurations, aggregation and the table on fake per-run results,
and the resumable runner (no processes: every run's JSON is already there)."""

import argparse
import json

import pytest

from commfuse.bench import train_table, training
from commfuse.bench.train_table import Config, aggregate, configs, parse_layout


def fake(step_ms, losses, exposed_ms=5.0, tps=1000.0, mfu=0.1):
    """A metrics JSON as `commfuse train --metrics-json` writes it (the fields read)."""
    return {"summary": {"median_step_s": step_ms / 1e3, "median_tokens_per_s": tps,
                        "median_mfu": mfu,
                        "exposed_comm_s": None if exposed_ms is None else exposed_ms / 1e3},
            "steps": [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]}


def test_layouts_and_configs():
    assert parse_layout("tp2") == (2, 1, 1) and parse_layout("up4") == (1, 4, 1)
    assert parse_layout("tp2xdp2") == (2, 1, 2)
    for bad in ("tp", "2", "tp2+dp2", "xx2", "tp0"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(bad)
    cs = configs(["tiny", "small"], ["tp2", "dp2"], ["none", "commfuse"])
    assert [c.key for c in cs[:3]] == ["tiny-tp2-none", "tiny-tp2-commfuse", "tiny-dp2-none"]
    assert len(cs) == 8 and cs[-1] == Config("small", 1, 1, 2, "commfuse")
    assert Config("tiny", 2, 1, 2, "none").layout == "tp2xdp2"
    with pytest.raises(ValueError, match="unknown method"):
        configs(["tiny"], ["tp2"], ["fast"])
    with pytest.raises(ValueError, match="unknown method"):
        configs(["tiny"], ["tp2"], ["none-torch"])  # train has no collective flag
    with pytest.raises(ValueError, match="unknown method"):
        configs(["tiny"], ["tp2"], ["fast-qs"])
    # query-split forced on / off: TP layouts only
    cs = configs(["tiny"], ["tp2", "dp2"], ["commfuse-qs", "auto-noqs", "auto"])
    assert [c.key for c in cs] == ["tiny-tp2-commfuse-qs", "tiny-tp2-auto-noqs", "tiny-tp2-auto",
                                   "tiny-dp2-auto"]
    assert [c.query_split for c in cs] == [True, False, None, None]
    # "@MODEL": commfuse train --hardware MODEL, after the query-split suffix
    cs = configs(["tiny"], ["tp2"], ["auto@cpu-testbed", "commfuse-qs@measured", "auto"])
    assert [(c.method, c.query_split, c.hardware, c.label) for c in cs] == [
        ("auto", None, "cpu-testbed", "auto@cpu-testbed"),
        ("commfuse", True, "measured", "commfuse-qs@measured"), ("auto", None, None, "auto")]
    with pytest.raises(ValueError, match="unknown method"):
        configs(["tiny"], ["tp2"], ["auto@a-laptop"])


def test_train_flags_are_commfuse_train_flags():
    from commfuse.train.config import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(Config("tiny", 2, 1, 1, "commfuse-m4").train_flags()))
    assert (cfg.tp, cfg.method, cfg.splits, cfg.topology) == (2, "commfuse", 4, "ring")
    cfg = config_from_args(p.parse_args(Config("small", 1, 2, 1, "commfuse").train_flags()))
    assert (cfg.preset, cfg.up, cfg.splits) == ("small", 2, None)  # the cost model picks m
    cfg = config_from_args(p.parse_args(Config("tiny", 2, 1, 1, "auto",
                                               hardware="cpu-testbed").train_flags()))
    assert (cfg.method, cfg.hardware) == ("auto", "cpu-testbed")
    assert config_from_args(p.parse_args(Config("tiny", 2, 1, 1, "auto").train_flags())) \
        .hardware == "measured"
    cfg = config_from_args(p.parse_args(Config("tiny", 1, 1, 2, "sliced").train_flags()))
    assert (cfg.dp, cfg.method, cfg.chunks) == (2, "sliced", 4)
    for qs, want in ((True, (True, False)), (False, (False, True)), (None, (False, False))):
        cfg = config_from_args(p.parse_args(Config("tiny", 2, 1, 1, "auto",
                                                   query_split=qs).train_flags()))
        assert (cfg.query_split, cfg.no_query_split) == want


def test_aggregate_medians_ratios_and_loss_check():
    none, cf, sl = (Config("tiny", 2, 1, 1, m) for m in ("none", "commfuse", "sliced"))
    other = Config("tiny", 1, 1, 2, "commfuse")  # a layout without a none run
    runs = {none: [fake(100, [5.0, 4.0]), fake(120, [5.0, 4.0]), fake(110, [5.0, 4.0])],
            cf: [fake(80, [5.0, 4.0 + 1e-6], tps=1500), fake(90, [5.0, 4.0])],
            sl: [fake(95, [5.0, 4.1], exposed_ms=None)], other: [fake(50, [1.0])],
            Config("tiny", 2, 1, 1, "auto"): []}
    rows = {r["config"]: r for r in aggregate(runs, {cf: (0.07, 0.05)}, loss_tol=1e-4)}
    assert len(rows) == 4  # a configuration without runs has no row
    assert rows[none]["step_s"] == pytest.approx(0.110) and rows[none]["repeats"] == 3
    assert rows[none]["vs_none"] == pytest.approx(1.0)
    assert rows[cf]["step_s"] == pytest.approx(0.085)
    assert rows[cf]["vs_none"] == pytest.approx(0.085 / 0.110)
    assert rows[cf]["tokens_per_s"] == 1250 and rows[cf]["loss_check"] == "equal"
    assert (rows[cf]["predicted_s"], rows[cf]["limit_s"]) == (0.07, 0.05)
    assert rows[sl]["loss_check"].startswith("differ (max rel 2.5e-02")
    assert rows[sl]["exposed_s"] is None and rows[sl]["predicted_s"] is None
    assert rows[other]["vs_none"] is None and rows[other]["loss_check"] == "no none run"
    short = aggregate({none: [fake(1, [1.0, 2.0])], cf: [fake(1, [1.0])]})
    assert short[1]["loss_check"] == "1 steps vs 2"


def test_markdown_table():
    none, cf = Config("small", 1, 2, 1, "none"), Config("small", 1, 2, 1, "commfuse")
    rows = aggregate({none: [fake(200, [3.0], mfu=0.2)], cf: [fake(150, [3.0], exposed_ms=None)]},
                     {cf: (0.140, 0.1)})
    meta = {"title": "T", "date": "d", "machine": "m", "torch": "t", "link": "l", "run": "r",
            "command": "commfuse bench train x", "hw": "cpu-testbed", "step_model": "s",
            "loss_tol": 1e-4, "exposed_iters": 3}
    doc = train_table.markdown(rows, meta)
    lines = doc.splitlines()
    head = lines.index(train_table.HEADER)
    assert lines[head + 1] == "|" + "---|" * 11
    assert lines[head + 2] == "| small | up2 | none | 200.0 | 1.000 | 1,000 | 20.00% | 5.0 | - " \
                              "| - | equal |"
    assert lines[head + 3] == "| small | up2 | commfuse | 150.0 | 0.750 | 1,000 | 10.00% | - | " \
                              "140.0 | 100.0 | equal |"
    assert "`commfuse bench train x`" in doc and "cpu-testbed" in doc


def test_runner_resumes_from_existing_runs(tmp_path, monkeypatch, capsys):
    p = argparse.ArgumentParser()
    training.add_arguments(p)
    out, doc = tmp_path / "out", tmp_path / "doc.md"
    args = p.parse_args(["--presets", "tiny", "--layouts", "tp2,dp2", "--methods",
                         "none,commfuse", "--steps", "2", "--out", str(out), "--doc", str(doc),
                         "--local"])
    out.mkdir()
    for i, c in enumerate(configs(["tiny"], ["tp2", "dp2"], ["none", "commfuse"])):
        (out / f"{c.key}-r1.json").write_text(json.dumps(fake(100 + 10 * i, [4.0, 3.0])))

    def no_runs(*a):
        raise AssertionError("a run with a JSON already there was started again")

    monkeypatch.setattr(training, "run_one", no_runs)
    assert args.run(args) == 0
    text = doc.read_text()
    assert "| tiny | tp2 | commfuse | 110.0 | 1.100 |" in text
    assert "| tiny | dp2 | commfuse | 130.0 | 1.083 |" in text
    said = capsys.readouterr().out
    assert said.count("from an earlier run") == 4 and "wrote " + str(doc) in said
    # a failed run: reported, the rest still tabled, exit code 1
    (out / "tiny-dp2-commfuse-r1.json").unlink()
    monkeypatch.setattr(training, "run_one", lambda *a: 3)
    assert args.run(args) == 1
    assert "tiny dp2 commfuse FAILED (exit 3)" in capsys.readouterr().out
    assert "| tiny | dp2 | none |" in doc.read_text()


def test_prediction_of_a_configuration():
    args = argparse.Namespace(seq_len=128, batch_size=8, dtype="float32", hw="cpu-testbed")
    step, limit = training.predict(Config("tiny", 2, 1, 1, "commfuse"), args)
    assert 0 < limit <= step
    # the whole step: the ops' step plus attention, elementwise work, loss and optimizer
    from commfuse.models.config import LlamaConfig
    from commfuse.parallel.config import ParallelDims
    from commfuse.sim.choose import STEP_OVERHEAD_S
    from commfuse.sim.step.timing import OpTimer, simulate_step

    ops = simulate_step(LlamaConfig.preset("tiny", max_seq_len=128),
                        ParallelDims(2, 1, 1, "commfuse", {}, world_size=2), "cpu-testbed",
                        seq=128, batch=8, micro_batch=8, dtype_bytes=4,
                        timer=OpTimer(4, STEP_OVERHEAD_S["cpu"]))
    assert step > 1.1 * ops.step_s
    assert step - limit == pytest.approx(ops.step_s - ops.limit_s)  # the same exposed part
    assert training.predict(Config("tiny", 3, 1, 1, "none"), args) == (None, None)  # 4 heads


def test_each_layouts_methods_rotate_between_repeats():
    from commfuse.bench.train_table import rotated
    cs = configs(["tiny"], ["tp2", "dp2"], ["none", "commfuse", "auto"])
    first = [(c.layout, c.method) for c in rotated(cs, 0)]
    assert first == [(c.layout, c.method) for c in cs]
    second = [(c.layout, c.method) for c in rotated(cs, 1)]
    assert second == [("tp2", "commfuse"), ("tp2", "auto"), ("tp2", "none"),
                      ("dp2", "commfuse"), ("dp2", "auto"), ("dp2", "none")]
    assert sorted(map(str, rotated(cs, 2))) == sorted(map(str, cs))
    assert [c.method for c in rotated(cs, 3)][:3] == ["none", "commfuse", "auto"]

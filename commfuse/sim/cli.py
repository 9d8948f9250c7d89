"""`commfuse simulate`: predicted time and exposed communication of every method.

    commfuse simulate --op matmul_rs --world 8 --shape 65536,4096,4096 --hw h100-nvlink
    commfuse simulate --table1
    commfuse simulate --calibrate FIT.json [--against OTHER.json] [--auto-check SWEEP.json]

Whole-model steps and layouts: `commfuse plan` (`commfuse.sim.plan.cli`).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from commfuse import sim
from commfuse.schedule import OPS
from commfuse.trace import write_gantt


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="commfuse simulate",
        description="Time every method's schedule on a hardware model (commfuse.sim). "
                    "Shapes are the full logical GEMM (M, K, N); see commfuse.sim.op_costs.")
    p.add_argument("--op", default="mlp", choices=("mlp", *OPS),
                   help="one op, or the TPSP MLP forward (AG->FC1, FC2->RS); default mlp")
    p.add_argument("--world", type=int, default=4, help="group size W (default 4)")
    p.add_argument("--shape", default="8192,4096,4096", help="M,K,N for a single op")
    p.add_argument("--tokens", type=int, default=32 * 4096, help="mlp: batch*seq")
    p.add_argument("--d-model", type=int, default=4096, help="mlp: model width (hidden 4x)")
    p.add_argument("--layers", type=int, default=1, help="mlp: layers back to back")
    p.add_argument("--hw", default="h100-nvlink", choices=sorted(sim.PRESETS),
                   help="hardware preset (default h100-nvlink)")
    p.add_argument("--dtype-bytes", type=float, default=2, help="bytes per element (bf16: 2)")
    p.add_argument("--chunks", type=int, default=4, help="sliced: chunk count")
    p.add_argument("--trace", default=None,
                   help="write each method's timeline to TRACE.<method>.json (Chrome trace)")
    p.add_argument("--png", default=None,
                   help="write every method's timeline as one PNG Gantt chart (first 8 ranks; "
                        "needs matplotlib)")
    p.add_argument("--table1", action="store_true",
                   help="print the paper's Table 1 comparison instead")
    p.add_argument("--calibrate", metavar="BENCH_JSON",
                   help="fit the --hw preset (default here: cpu-testbed) to a `commfuse bench op` "
                        "JSON and print predicted vs measured for every op and method")
    p.add_argument("--against", metavar="BENCH_JSON",
                   help="with --calibrate: compare with this separate run instead of the one "
                        "calibrated on")
    p.add_argument("--auto-check", metavar="BENCH_JSON", action="append", default=[],
                   help="with --calibrate: the method that method=\"auto\" would choose on the "
                        "fitted model for every op and shape of this (prior) run, evaluated "
                        "against that run's measured medians: ratio to the best fixed method "
                        "(repeatable)")
    return p


def main_simulate(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.calibrate:
        import json

        from commfuse.sim import calibrate as cal

        with open(a.calibrate) as f:
            results = json.load(f)["results"]
        base = a.hw if a.hw != "h100-nvlink" else "cpu-testbed"
        hw = cal.calibrate(results, base)
        if a.against:
            with open(a.against) as f:
                results = json.load(f)["results"]
        print(cal.markdown(cal.compare(results, hw), hw))
        for path in a.auto_check:
            with open(path) as f:
                print(f"\n{path}: auto's choice evaluated against the measured medians of a "
                      f"prior run\n")
                print(cal.auto_markdown(cal.auto_check(json.load(f)["results"], hw)))
        return 0
    if a.table1:
        r = sim.paper_table1(chunks=a.chunks)
        hw = r["hardware"]
        print(f"Table 1 regime: TP=4, TPSP MLP fwd, (32, 4096, 4096), bf16; calibrated "
              f"{hw.gemm_flops / 1e12:.1f} TFLOP/s, {hw.link_bandwidth / 1e9:.1f} GB/s")
        print(f"{'method':<10}{'predicted ms':>14}{'paper ms':>10}{'exposed ms':>12}"
              f"{'paper exp.':>12}")
        for name in ("vanilla", "sliced", "commfuse"):
            exp_paper = r["paper"]["vanilla_comm" if name == "vanilla" else name + "_exposed"]
            print(f"{name:<10}{r[name] * 1e3:>14.1f}{r['paper'][name] * 1e3:>10.1f}"
                  f"{r[name + '_exposed'] * 1e3:>12.1f}{exp_paper * 1e3:>12.1f}")
        return 0
    rows = []
    from commfuse.schedule import VARIANTS  # the bench's methods, by the same labels
    from commfuse.sim.choose import STEP_OVERHEAD_S, best_splits
    from commfuse.sim.simulate import mlp_specs

    for name, (method, opts) in VARIANTS.items():
        if name in ("none-torch", "auto"):
            continue
        opts = dict(opts, chunks=a.chunks)
        if a.op == "mlp":  # commfuse without splits: each op's own m, as the ops pick it
            specs = [replace(spec, splits=best_splits(spec.op, spec.shape, a.world,
                                                      a.dtype_bytes, sim.preset(a.hw),
                                                      STEP_OVERHEAD_S["cpu"]))
                     if method == "commfuse" and "splits" not in opts else spec
                     for spec in mlp_specs(method, a.world, a.tokens, a.d_model, **opts)]
            r = sim.simulate_ops(specs * a.layers, a.world, a.dtype_bytes, a.hw,
                                 timeline=bool(a.trace or a.png))
        else:
            shape = tuple(int(x) for x in a.shape.split(","))
            if method == "commfuse" and "splits" not in opts:
                opts["splits"] = best_splits(a.op, shape, a.world, a.dtype_bytes,
                                             sim.preset(a.hw), STEP_OVERHEAD_S["cpu"])
            r = sim.simulate_op(a.op, method, a.world, shape, a.dtype_bytes, a.hw,
                                timeline=bool(a.trace or a.png), **opts)
        if a.trace:
            r.write_trace(f"{a.trace}.{name}.json")
        rows.append((name, r))
    base = rows[0][1].total_s
    print(f"{a.op} W={a.world} on {a.hw}")
    print(f"{'method':<17}{'total ms':>10}{'compute ms':>12}{'exposed ms':>12}{'of none':>9}")
    for name, r in rows:
        print(f"{name:<17}{r.total_s * 1e3:>10.3f}{r.compute_s * 1e3:>12.3f}"
              f"{r.exposed_comm_s * 1e3:>12.3f}{r.total_s / base:>9.2f}")
    if a.png:
        try:
            write_gantt([(f"{name}: {r.total_s * 1e3:.3f} ms", r.timeline) for name, r in rows],
                        a.png, f"{a.op} W={a.world} on {a.hw}: predicted timelines")
            print(f"wrote {a.png}")
        except ImportError:
            print("matplotlib not installed: no PNG (pip install 'commfuse[bench]')")
    return 0

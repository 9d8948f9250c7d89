"""Fit a hardware model to `commfuse bench` results, and compare its predictions with them.

``calibrate(results)`` takes the op results of a bench JSON (the four fused ops, forward) and
scales a base preset's ``gemm_flops`` so the simulated compute of method ``none`` matches the
measured compute alone, and its ``link_bandwidth`` so the simulated collective of ``none``
matches the measured communication alone (a few fixed-point rounds: time is close to
inversely proportional to both). Everything else (efficiency curve, interference, duplex)
stays the preset's. ``compare`` then predicts every method of every result on the fitted
model: the "predicted vs measured" table of the simulator issue.

    commfuse simulate --calibrate docs/benchmarks/2026-11-29-duplex/op-forward/op-2r.json
"""

from __future__ import annotations

from dataclasses import replace

from commfuse.bench.measure import VARIANTS as BENCH_VARIANTS
from commfuse.sim.hardware import Hardware, preset

# the bench's methods the simulator models (not gloo's own collectives, not auto itself)
VARIANTS = {label: v for label, v in BENCH_VARIANTS.items() if label not in ("none-torch", "auto")}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def op_shape(r: dict) -> tuple[int, int, int]:
    """The (M, K, N) of a bench op result, in the simulator's conventions (`op_costs`)."""
    S, D, W = r["seq"], r["d_model"], r["world"]
    return {"ag_matmul": (S, D, 4 * D // W), "matmul_rs": (S, 4 * D // W, D),
            "matmul_a2a": (S, D, 3 * D), "a2a_matmul": (S, D, D)}[r["workload"]]


def _simulate(r: dict, label: str, hw: Hardware):
    from commfuse.sim import simulate_op

    method, opts = VARIANTS[label]
    return simulate_op(r["workload"], method, r["world"], op_shape(r), DTYPE_BYTES[r["dtype"]],
                       hw, timeline=False, **opts)


def _ops(results: list[dict]) -> list[dict]:
    ops = [r for r in results if r["pass"] == "forward" and r["workload"] in
           ("ag_matmul", "matmul_rs", "matmul_a2a", "a2a_matmul")]
    if not ops:
        raise ValueError("no forward op results to calibrate from (run `commfuse bench op "
                         "--pass forward`)")
    return ops


def calibrate(results: list[dict], base: str | Hardware = "cpu-testbed",
              rounds: int = 4) -> Hardware:
    """The base hardware with gemm_flops and link_bandwidth fitted to ``results``."""
    hw = preset(base) if isinstance(base, str) else base
    ops = _ops(results)
    for _ in range(rounds):
        comp, comp_sim, comm, comm_sim = 0.0, 0.0, 0.0, 0.0
        for r in ops:
            none = next(m for m in r["methods"] if m["method"] == "none")
            s = _simulate(r, "none", hw)
            comp, comp_sim = comp + none["compute_ms"] / 1e3, comp_sim + s.compute_s
            comm, comm_sim = comm + r["comm_alone_ms"] / 1e3, comm_sim + s.total_s - s.compute_s
        hw = replace(hw, gemm_flops=hw.gemm_flops * comp_sim / comp,
                     link_bandwidth=hw.link_bandwidth * comm_sim / comm)
    return hw


def compare(results: list[dict], hw: Hardware) -> list[dict]:
    """Predicted and measured median per op and method (the methods the simulator knows)."""
    rows = []
    for r in _ops(results):
        for m in r["methods"]:
            if m["method"] in VARIANTS:
                pred = _simulate(r, m["method"], hw).total_s * 1e3
                rows.append({"op": r["workload"], "method": m["method"], "measured_ms": m["median_ms"],
                             "predicted_ms": pred, "error": pred / m["median_ms"] - 1})
    return rows


def markdown(rows: list[dict], hw: Hardware) -> str:
    out = [f"Fitted: gemm_flops {hw.gemm_flops / 1e9:.1f} GFLOP/s, link {hw.link_bandwidth * 8 / 1e9:.3f}"
           f" Gbit/s each way; the rest from the base preset.\n",
           "| op | method | measured ms | predicted ms | error |", "|---|---|---:|---:|---:|"]
    out += [f"| {r['op']} | {r['method']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
            f"{100 * r['error']:+.0f} % |" for r in rows]
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    out.append(f"\n{within} of {len(rows)} predictions within 15 % of the measured median.")
    return "\n".join(out)

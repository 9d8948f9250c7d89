"""Fit a hardware model to `commfuse bench` results, and compare its predictions with them.

``calibrate(results)`` takes the op results of a bench JSON (the four fused ops, forward) and
scales a base preset's ``gemm_flops`` so the simulated compute of method ``none`` matches the
measured compute alone, and its ``link_bandwidth`` so the simulated collective of ``none``
matches the measured communication alone (a few fixed-point rounds: time is close to
inversely proportional to both). Then the host costs: ``host_collective_s`` so that the
predicted medians of ``sliced`` (4 collectives per op) sum to the measured ones (bisection),
and what a piece costs and buys (``host_p2p_s`` per post and ``interference``, `fit_pieces`)
to the P2P methods at every piece count, the whole alternated a few times; last the model's
error on auto's choice (`choice_error`), which ``auto`` needs a predicted gain to exceed.
Everything else (efficiency curve, duplex) stays the preset's. ``compare`` then predicts every method of every result on the
fitted model: the "predicted vs measured" table of the simulator issue.

    commfuse simulate --calibrate bench-out/op-2r.json [--against OTHER_RUN.json]
"""

from __future__ import annotations

import math
from dataclasses import replace

from commfuse.schedule import VARIANTS as ALL_VARIANTS
from commfuse.sim import choose
from commfuse.sim.costs import OpSpec
from commfuse.sim.engine import Engine
from commfuse.sim.hardware import Hardware, preset
from commfuse.sim.simulate import simulate_op

# the bench's methods the simulator models (not gloo's own collectives, not auto itself).
# "commfuse" ran m=1 in results from before `commfuse` chose its splits per shape; newer
# results also have "commfuse-m1", and there "commfuse" (an m chosen at run time, not
# recorded) is left out (`_modelled`).
VARIANTS = {label: v for label, v in ALL_VARIANTS.items() if label not in ("none-torch", "auto")}
VARIANTS["commfuse"] = VARIANTS["commfuse-m1"]


def _modelled(r: dict, label: str) -> bool:
    """Whether the simulator can time bench result ``r``'s method ``label`` (see VARIANTS)."""
    return label in VARIANTS and not (
        label == "commfuse" and any(m["method"] == "commfuse-m1" for m in r["methods"]))
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def op_shape(r: dict) -> tuple[int, int, int]:
    """The (M, K, N) of a bench op result, in the simulator's conventions (`op_costs`)."""
    S, D, W = r["seq"], r["d_model"], r["world"]
    F = r.get("ffn") or 4 * D  # the MLP's hidden width (results before --ffn: 4D)
    return {"ag_matmul": (S, D, F // W), "matmul_rs": (S, F // W, D),
            "matmul_a2a": (S, D, 3 * D), "a2a_matmul": (S, D, D)}[r["workload"]]


def _simulate(r: dict, label: str, hw: Hardware):
    method, opts = VARIANTS[label]
    return simulate_op(r["workload"], method, r["world"], op_shape(r), DTYPE_BYTES[r["dtype"]],
                       hw, timeline=False, **opts)


def _total(r: dict, label: str, hw: Hardware) -> float:
    """`_simulate`'s ``total_s`` alone, the ranks timed as rank 0 where that is exact."""
    method, opts = VARIANTS[label]
    spec = OpSpec(r["workload"], method, op_shape(r), **opts)
    sym = not (hw.compute_straggler or hw.link_straggler)
    return max(Engine(hw, r["world"], [spec], DTYPE_BYTES[r["dtype"]], True, False,
                      sym).run()[0])


def _ops(results: list[dict]) -> list[dict]:
    ops = [r for r in results if r["pass"] == "forward" and r["workload"] in
           ("ag_matmul", "matmul_rs", "matmul_a2a", "a2a_matmul")]
    if not ops:
        raise ValueError("no forward op results to calibrate from (run `commfuse bench op "
                         "--pass forward`)")
    return ops


def calibrate(results: list[dict], base: str | Hardware = "cpu-testbed", rounds: int = 4,
              host: bool = True) -> Hardware:
    """The base hardware with gemm_flops, link_bandwidth and (``host``) the host cost per
    collective and what a piece costs and buys (`fit_pieces`) fitted to ``results``, and its
    ``choice_margin`` raised to the fitted model's `choice_error` on them where that is
    larger; ``host=False`` keeps the base's host costs and interference."""
    hw = preset(base) if isinstance(base, str) else base
    ops = _ops(results)
    for _ in range(3 if host else 1):
        hw = _fit_rates(hw, ops, rounds)
        if host:
            hw = _fit_host(hw, ops, "host_collective_s", COLLECTIVE_LABELS)
            hw = fit_pieces(hw, ops, rounds=2)  # warm-started each round
    return replace(hw, choice_margin=min(0.5, max(hw.choice_margin, choice_error(ops, hw))))


COLLECTIVE_LABELS = ("sliced",)  # the bench variants that fit each host cost
P2P_LABELS = ("decompose", "commfuse", "commfuse-m1", "commfuse-m2", "commfuse-m4", "commfuse-m8",
              "commfuse-direct")


def _fit_host(hw: Hardware, ops: list[dict], field: str, labels, iters: int = 24) -> Hardware:
    """``hw`` with ``field`` >= 0 set so that the predicted medians of ``labels`` sum to the
    measured ones (0 if the model is already slower; predicted time grows with it)."""
    pairs = [(r, m) for r in ops for m in r["methods"]
             if m["method"] in labels and _modelled(r, m["method"])]
    if not pairs:
        return hw
    measured = sum(m["median_ms"] for _, m in pairs) / 1e3

    def excess(v: float) -> float:
        h = replace(hw, **{field: v})
        return sum(_simulate(r, m["method"], h).total_s for r, m in pairs) - measured

    lo, hi = 0.0, 1e-3
    if excess(lo) >= 0:
        return replace(hw, **{field: 0.0})
    while excess(hi) < 0 and hi < 10.0:
        lo, hi = hi, 2 * hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return replace(hw, **{field: (lo + hi) / 2})


PIECE_RANGES = {"host_p2p_s": (0.0, 5e-3), "interference": (0.0, 2.0)}  # `fit_pieces`' bounds


def fit_pieces(hw: Hardware, ops: list[dict], rounds: int = 6, iters: int = 12) -> Hardware:
    """``hw`` with what a piece costs (``host_p2p_s``: host time per post, on the rank's own
    timeline) and what it buys (``interference``: how much the compute beside a moving piece
    slows, which sets how much of the transfer more pieces hide) fitted together to the P2P
    methods' medians at every piece count measured (decompose, commfuse at m = 1, 2, 4, 8,
    direct): the least squares of log(predicted / measured) over them, by golden-section
    search on each in `PIECE_RANGES`, alternated ``rounds`` times. A cost per piece moves
    the prediction in proportion to the pieces, the overlap's slowdown most where the pieces
    hide the most, so results at several m tell them apart; with one m only the sum is
    fitted (both move it). Unchanged where no P2P method was measured."""
    pairs = [(r, m["method"], m["median_ms"] / 1e3) for r in ops for m in r["methods"]
             if m["method"] in P2P_LABELS and _modelled(r, m["method"])]
    if not pairs:
        return hw

    def loss(h: Hardware) -> float:
        return sum(math.log(_total(r, label, h) / t) ** 2 for r, label, t in pairs)

    g = (math.sqrt(5) - 1) / 2
    for _ in range(rounds):
        for field, (lo, hi) in PIECE_RANGES.items():
            at = lambda v, f=field: loss(replace(hw, **{f: v}))
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            fa, fb = at(a), at(b)
            for _ in range(iters):
                if fa <= fb:
                    hi, b, fb = b, a, fa
                    a = hi - g * (hi - lo)
                    fa = at(a)
                else:
                    lo, a, fa = a, b, fb
                    b = lo + g * (hi - lo)
                    fb = at(b)
            hw = replace(hw, **{field: (lo + hi) / 2})
    return hw


def choice_error(results: list[dict], hw: Hardware, quantile: float = 0.9) -> float:
    """The model's error on the choice ``auto`` makes: over every forward op result and every
    modelled method X measured beside the default (`commfuse.sim.choose.default`: commfuse at
    the m `best_splits` picks on ``hw``, where that m was measured), |log((predicted X /
    predicted default) / (measured X / measured default))|, at ``quantile`` (0 without such
    pairs). What a predicted gain over the default must exceed to be told apart from the
    model's error and the runs' spread (`Hardware.choice_margin`)."""
    errors = []
    for r in _ops(results):
        med = {m["method"]: m["median_ms"] for m in r["methods"] if _modelled(r, m["method"])}
        m = choose.best_splits(r["workload"], op_shape(r), r["world"], DTYPE_BYTES[r["dtype"]],
                               hw, choose.STEP_OVERHEAD_S["cpu"])
        ref = next((k for k in (f"commfuse-m{m}", "commfuse" if m == 1 else "") if k in med),
                   None)
        if ref is None:
            continue
        pred = lambda label: _simulate(r, label, hw).total_s
        p_ref = pred(ref)
        errors += [abs(math.log(pred(x) / p_ref / (t / med[ref]))) for x, t in med.items()
                   if x != ref and VARIANTS[x] != VARIANTS[ref]]
    if not errors:
        return 0.0
    errors.sort()
    return errors[min(len(errors) - 1, int(quantile * len(errors)))]


def _fit_rates(hw: Hardware, ops: list[dict], rounds: int) -> Hardware:
    """gemm_flops and link_bandwidth so that ``none`` matches compute and communication alone."""
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
            if _modelled(r, m["method"]):
                pred = _simulate(r, m["method"], hw).total_s * 1e3
                rows.append({"op": r["workload"], "method": m["method"], "measured_ms": m["median_ms"],
                             "predicted_ms": pred, "error": pred / m["median_ms"] - 1})
    return rows


def markdown(rows: list[dict], hw: Hardware) -> str:
    out = [f"Fitted: gemm_flops {hw.gemm_flops / 1e9:.1f} GFLOP/s, link {hw.link_bandwidth * 8 / 1e9:.3f}"
           f" Gbit/s each way, host {hw.host_collective_s * 1e3:.2f} ms per collective and "
           f"{hw.host_p2p_s * 1e3:.2f} ms per P2P post, compute {hw.interference:.2f} slower "
           f"beside transfers, auto's margin over the default {100 * hw.choice_margin:.0f} %; "
           "the rest from the base preset.\n",
           "| op | method | measured ms | predicted ms | error |", "|---|---|---:|---:|---:|"]
    out += [f"| {r['op']} | {r['method']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
            f"{100 * r['error']:+.0f} % |" for r in rows]
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    out.append(f"\n{within} of {len(rows)} predictions within 15 % of the measured median.")
    return "\n".join(out)


def _canon(method: str, opts: dict) -> tuple:
    """(method, options) with default options dropped, to match auto's candidates to labels."""
    return method, tuple(sorted((k, v) for k, v in opts.items()
                                if (k, v) not in (("topology", "ring"), ("splits", 1))))


def auto_check(results: list[dict], hw: Hardware) -> list[dict]:
    """What ``method="auto"`` would choose on ``hw`` for every op result, evaluated against the
    measured medians of that (prior) run: its choice among all of auto's candidates (None
    where that candidate was not measured), and its choice among the measured ones only."""
    rows = []
    for r in _ops(results):
        med = {m["method"]: m["median_ms"] for m in r["methods"] if _modelled(r, m["method"])}
        label_of = {_canon(*VARIANTS[k]): k for k in med}  # the labels this result measured
        measured_only = [c for c in choose.CANDIDATES if _canon(*c) in label_of]
        best = min(med, key=med.get)
        args = (r["workload"], op_shape(r), r["world"], DTYPE_BYTES[r["dtype"]], hw,
                choose.STEP_OVERHEAD_S["cpu"])
        full = choose.choice(*args)[:2]
        choice = label_of.get(_canon(*full))
        among = label_of[_canon(*choose.fastest(*args, candidates=measured_only)[:2])]
        rows.append({"op": r["workload"], "seq": r["seq"], "choice": choice,
                     "choice_name": choice or _name(*full), "best": best, "best_ms": med[best],
                     "ratio": med[choice] / med[best] if choice else None,
                     "among_measured": among, "among_ratio": med[among] / med[best]})
    return rows


def _name(method: str, opts: dict) -> str:
    return " ".join([method] + [f"{k}={v}" for k, v in _canon(method, opts)[1]])


def auto_markdown(rows: list[dict]) -> str:
    """The table of `auto_check`."""
    out = ["| op | seq | auto's choice | / best | among measured | / best | best measured | ms |",
           "|---|---:|---|---:|---|---:|---|---:|"]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "not measured"
        out.append(f"| {r['op']} | {r['seq']} | {r['choice_name']} | {ratio} | "
                   f"{r['among_measured']} | {r['among_ratio']:.3f} | {r['best']} | "
                   f"{r['best_ms']:.1f} |")
    ev = [r["ratio"] for r in rows if r["ratio"] is not None]
    am = [r["among_ratio"] for r in rows]
    out.append(f"\nauto's choice within 5 % of the best measured fixed method in "
               f"{sum(x <= 1.05 for x in ev)} of {len(ev)} measured cases (worst "
               f"{max(ev, default=float('nan')):.3f}; {len(rows) - len(ev)} not measured); "
               f"among the measured candidates only: {sum(x <= 1.05 for x in am)} of {len(am)} "
               f"(worst {max(am):.3f}).")
    return "\n".join(out)

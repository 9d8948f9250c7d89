"""`commfuse plan`: rank every valid parallel layout and method of a model on N devices.

    commfuse plan --model 70b --devices 256 --hw h100-nvlink --seq 4096
"""

from __future__ import annotations

import argparse
import os
import time

from commfuse import sim
from commfuse.schedule import TOPOLOGIES
from commfuse.sim.model_ops import MODELS
from commfuse.trace import write_gantt

DESCRIPTION = """\
Enumerate every (tp, up, dp) layout of MODEL on DEVICES ranks that the parallel plans accept
(tp divides the heads, kv heads and FFN; up the heads and kv heads; tp*up the sequence; dp the
global batch and the rows of every DP-sharded weight; TP and UP are not combined), time one
training step of each under every method on the simulator (commfuse.sim.simulate_step), and
print them ranked by predicted step time, best first. Writes the best plan's predicted
timeline as a Chrome trace (open in ui.perfetto.dev) and a PNG Gantt chart.

What a step is: for every micro-batch, the forward and backward of every block and of the
output head, with the fused ops the plans use (TPSP: AG->GEMM q|k|v and gate|up, GEMM->RS
out-proj and down; Ulysses: GEMM->a2a, a2a->GEMM; ZeRO-3 DP: parameter all-gather fused with
each GEMM, gradient reduce-scatter fused with the weight-gradient GEMM; backward the dual
ops, and the gathers AG->GEMM repeats since it saves only shards), attention as GEMMs of
(S, head_dim, S) (causal: half of QK^T and PV), then once per step the all-reduce of the
replicated gradients. Under TP/UP x DP the plans gather the TP/UP weights with a
plain all-gather before each op and again in backward: counted as exposed. Not counted:
elementwise work, the optimizer step, pipeline parallelism, activation memory (a plan may not
fit).

How it is timed: each distinct op is simulated once on its own group (tp/up ranks are
neighbours, dp strides over them; a group wider than --node-size uses --inter-hw's links), and
the times are summed along the step: no overlap between consecutive ops, no contention
between groups (see commfuse/sim/step.py).

Columns: step s (one step of the global batch), tokens/s, MFU = flops_per_token * tokens /
step / (devices * peak), flops_per_token = 6N + 12*L*H*Q*T (PaLM appendix B, as nanoGPT and
`commfuse train`), peak = the --hw preset's dense GEMM flop/s; exposed = share of the step
not hidden behind compute; then the seconds per step spent in ops on the TP/UP group, on the
DP group (fused ops, plain weight gathers, grad all-reduce), in local GEMMs (attention, weight
gradients, UP's MLP) and in the all-reduce over all ranks (embedding, norms)."""

EPILOG = """\
examples:
  commfuse plan --model 70b --devices 256 --hw h100-nvlink --seq 4096
  commfuse plan --model 7b --devices 64 --hw a100-nvlink --batch 256 --micro-batch 2
  commfuse plan --model 70b --devices 1024 --methods commfuse,auto --splits 2
  commfuse plan --model tiny --devices 4 --hw cpu-testbed --inter-hw same --seq 256"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commfuse plan", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="70b", choices=sorted(MODELS), metavar="MODEL",
      help=f"model preset, one of {', '.join(sorted(MODELS))}: Llama 2 7B/13B, Llama 3 "
           "8B/70B, Llama 3.2 1B, or the CPU-sized tiny/small (default 70b; shapes and "
           "sources in commfuse/sim/model_ops.py)")
    a("--set", action="append", default=[], metavar="FIELD=VALUE",
      help="override a field of the model preset (a LlamaConfig field, e.g. vocab_size=131072 "
           "or n_layers=40); repeatable")
    a("--devices", type=int, required=True, help="ranks (GPUs/NPUs/cores) in the job")
    a("--hw", default="h100-nvlink", choices=sorted(sim.PRESETS), metavar="PRESET",
      help=f"hardware of one rank and of the links inside a node, one of "
           f"{', '.join(sorted(sim.PRESETS))} (default h100-nvlink; commfuse/sim/hardware.py)")
    a("--inter-hw", default="multinode-400g", choices=sorted(sim.PRESETS) + ["same"],
      metavar="PRESET", help="links of groups that span nodes (that preset's link fields "
                             "only; default multinode-400g: one 400 Gbit/s NIC per GPU); "
                             "'same': --hw's links everywhere")
    a("--node-size", type=int, default=8, help="ranks per node (default 8)")
    a("--seq", type=int, default=None,
      help="sequence length (default: 4096, or the model's max_seq_len if shorter)")
    a("--batch", type=int, default=None,
      help="global batch in sequences per step (default: --devices)")
    a("--micro-batch", type=int, default=1,
      help="sequences per DP replica per forward/backward; the step runs batch / (dp * "
           "micro-batch) of them (default 1)")
    a("--methods", default="none,sliced,decompose,commfuse",
      help="comma-separated methods to compare: none, sliced, decompose, commfuse, auto "
           "(auto: per op, the fastest of commfuse.auto's candidates) (default: the four)")
    a("--splits", type=int, default=1, help="decompose/commfuse: sub-slices per slice (m)")
    a("--topology", default="ring", choices=TOPOLOGIES, help="decompose/commfuse")
    a("--chunks", type=int, default=4, help="sliced: chunks per op (default 4)")
    a("--dtype-bytes", type=float, default=2, help="bytes per element (bf16: 2)")
    a("--top", type=int, default=20, help="rows to print (default 20; 0: all)")
    a("--out", default="out/plan",
      help="folder for the best plan's MODEL-DEVICES.trace.json and .png (default out/plan)")
    a("--no-files", action="store_true", help="print only; write no trace or PNG")
    return p


def main_plan(argv=None) -> int:
    a = _parser().parse_args(argv)
    from commfuse.parallel.config import ParallelDims
    from commfuse.sim.model_ops import model_config
    from commfuse.sim.plan import method_options, plan, table
    from commfuse.sim.step import OpTimer, simulate_step

    cfg = _with_overrides(model_config(a.model), a.set)
    seq = a.seq or min(4096, cfg.max_seq_len)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    inter = None if a.inter_hw == "same" else a.inter_hw
    opts = {"splits": a.splits, "topology": a.topology, "chunks": a.chunks}
    kw = dict(seq=seq, batch=a.batch, micro_batch=a.micro_batch, dtype_bytes=a.dtype_bytes,
              inter_hw=inter, node_size=a.node_size)
    t0, timer = time.perf_counter(), OpTimer(a.dtype_bytes)
    plans, rejected = plan(cfg, a.devices, a.hw, methods=methods, method_opts=opts,
                           timer=timer, **kw)
    elapsed = time.perf_counter() - t0
    batch = a.batch or a.devices
    print(f"{a.model}{''.join(' ' + x for x in a.set)} ({cfg.n_layers} layers, d={cfg.dim}, "
          f"{cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, ffn {cfg.ffn_hidden}, vocab "
          f"{cfg.vocab_size}) on {a.devices} x {a.hw}, "
          f"nodes of {a.node_size} linked by {a.inter_hw}; {batch} x {seq} tokens per step, "
          f"micro-batch {a.micro_batch}")
    if not plans:
        print("no valid layout:")
        for tp, up, dp, why in rejected:
            print(f"  tp={tp} up={up} dp={dp}: {why}")
        return 1
    print(table(plans, a.top or None))
    best = plans[0]
    print(f"\nbest: {best.name}: {best.result.step_s:.3f} s per step, MFU "
          f"{100 * best.result.mfu:.1f} %, {best.result.micro_batches} micro-batch(es)")
    if rejected:
        print(f"{len(rejected)} layouts rejected, e.g. tp={rejected[0][0]} up={rejected[0][1]} "
              f"dp={rejected[0][2]}: {rejected[0][3]}")
    print(f"{len(plans)} plans timed in {elapsed:.2f} s ({timer.simulations} op simulations)")
    if a.no_files:
        return 0
    dims = ParallelDims(tp=best.tp, up=best.up, dp=best.dp, method=best.method,
                        method_opts=method_options(best.method, opts), world_size=a.devices)
    r = simulate_step(cfg, dims, a.hw, timeline=True, timer=timer, **kw)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{a.model}-{a.devices}")
    r.write_trace(stem + ".trace.json")
    print(f"wrote {stem}.trace.json")
    spans = r.timeline
    panels = [("one micro-batch (every block forward, the head, every block backward) and the "
               "gradient sync, as rank 0 sees it", spans),
              ("block 0 forward", [s for s in spans if s.label.startswith("L0 fwd ")]),
              ("block 0 backward", [s for s in spans if s.label.startswith("L0 bwd ")])]
    try:
        write_gantt(panels, stem + ".png", f"{a.model} on {a.devices} x {a.hw}: {best.name}")
        print(f"wrote {stem}.png")
    except ImportError:
        print("matplotlib not installed: no PNG (pip install 'commfuse[bench]')")
    return 0


def _with_overrides(cfg, sets: list[str]):
    """``cfg`` with FIELD=VALUE overrides (ints, floats or true/false), validated again."""
    import dataclasses

    changes = {}
    for item in sets:
        field, sep, value = item.partition("=")
        if not sep or field not in {f.name for f in dataclasses.fields(cfg)}:
            raise SystemExit(f"commfuse plan: --set wants FIELD=VALUE with a LlamaConfig field, "
                             f"got {item!r}")
        low = value.lower()
        changes[field] = low == "true" if low in ("true", "false") else \
            float(value) if "." in value or "e" in low else int(value)
    try:
        return dataclasses.replace(cfg, **changes)
    except ValueError as e:
        raise SystemExit(f"commfuse plan: {e}") from e

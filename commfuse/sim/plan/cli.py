"""`commfuse plan`: rank every valid parallel layout and method of a model on N devices.

    commfuse plan --model 70b --devices 256 --hw h100-nvlink --seq 4096
"""

from __future__ import annotations

import argparse
import os
import time

from commfuse import sim
from commfuse.schedule import TOPOLOGIES
from commfuse.sim.step.ops import MODELS
from commfuse.trace import write_gantt

DESCRIPTION = """\
Enumerate every (tp, up, dp) layout of MODEL on DEVICES ranks that the parallel plans accept
(tp divides the heads, kv heads and FFN; up the heads and kv heads; tp*up the sequence; dp the
global batch and the rows of every DP-sharded weight; TP and UP are not combined; for an MoE
model every expert-parallel size ep that divides dp and the experts; for a Mamba hybrid tp
splitting its SSM heads and groups, no UP), predict one
training step of each under every method, and print them best first: the plans that fit in
the device's memory first, by tokens/s per device. Writes the best plan's predicted timeline
of its GEMMs and collectives as a Chrome trace (open in ui.perfetto.dev) and a PNG Gantt chart.

The GEMMs and collectives of a step (commfuse.sim.step.simulate_step): for every micro-batch, the
forward and backward of every block and of the output head, with the fused ops the plans use
(TPSP: AG->GEMM q|k|v and gate|up, GEMM->RS out-proj and down; Ulysses: GEMM->a2a,
a2a->GEMM; ZeRO-3 DP: parameter all-gather fused with each GEMM, gradient reduce-scatter fused
with the weight-gradient GEMM; backward the dual ops), and the all-reduce of the replicated
gradients. MoE layers (mixtral-8x7b, qwen3-30b-a3b, deepseek-v2-lite): the router GEMM, the
dispatch all-to-all fused with the experts' gate|up GEMM and their down GEMM fused with the
combine all-to-all on the ep group, with uniform routing's expected bytes of the
deduplicated dispatch (each rank sends one row per token and remote destination rank:
tokens x r x (ep-1)/ep rows, r = ep (1 - C(E - E/ep, top_k) / C(E, top_k)) the distinct
ranks a token's experts lie on); Mamba-2 layers (nemotron-h-8b): in_proj's AG->GEMM and
out_proj's GEMM->RS under TP, the conv1d and the scan as memory-bound work
(commfuse/sim/step/layers.py, work.py). Under TP/UP x DP the plans gather the TP/UP weights with a plain all-gather before
each op. Each distinct op is simulated once on its own group (tp/up ranks are neighbours, dp
strides over them; a group wider than --node-size uses --inter-hw's links), and the times are
summed along the step: no overlap between consecutive ops. GEMM efficiency and, on the Hopper
presets, fused attention come from published measurements (commfuse/sim/hardware.py);
compute slows under a preset's power limit.

The whole step (commfuse.sim.step.simulate_train_step; --ops-only leaves it out) adds: fused
attention; memory-bound work (norms, RoPE, SwiGLU, residuals, the cross-entropy on float32
logits, the AdamW step with gradient clipping) by bytes over the memory bandwidth;
activation checkpointing per block (--ac: none, selective = torchtitan's op policy, every
second matmul and all elementwise work recomputed, full = the block's forward again); under
--sharding fsdp (the default; torch FSDP2 as torchtitan runs it) one all-gather per block,
prefetched behind the neighbouring block's compute, the reduce-scatter in float32 behind the
backward, every parameter sharded over DP (method none; the fused methods keep their own
schedules), under --sharding commfuse this repository's ZeRO-3 (no prefetch, norms and
embedding replicated). Memory per rank (commfuse.sim.step.memory): float32 parameters, gradients
and AdamW states, activations under --ac, FSDP's gathered weights (root, current and
prefetched block), then the larger of the loss (float32 logits; under TP vocabulary-parallel,
with the head's gathered input) and one block's recompute and backward (under TP with the
whole-sequence gathered inputs, and the running fused op's buffer), plus the caching
allocator's reserve (15 % of reserved memory, as torch's max_memory_reserved reads); a plan
over the preset's memory is marked NO and ranked last. docs/planning.md holds the
validation against published runs. Not counted: pipeline parallelism, the CUDA context and
NCCL buffers, host overhead, float8 and torch.compile.

Columns (whole step): step s, tok/s/dev (tokens per step / step / devices, as torchtitan
logs TPS/GPU), MFU = flops_per_token * tokens / step / (devices * peak), flops_per_token =
6N + 12*L*H*Q*T (PaLM appendix B, as nanoGPT and `commfuse train`), peak = the --hw
preset's dense GEMM flop/s; mem GiB (the peak of one rank) and fits; then seconds per step
in the GEMMs and collectives (ops s), fused attention, memory-bound work, recompute, and
what FSDP's prefetch leaves exposed. --ops-only: step s, limit s (the same compute and bytes
with no dependency), tokens/s, MFU, exposed = share of the step not hidden behind compute,
then the seconds per step in ops on the TP/UP group, on the DP group (an MoE model's
expert-parallel all-to-alls too), in local GEMMs and in the all-reduce over all ranks."""

EPILOG = """\
examples:
  commfuse plan --model 70b --devices 256 --hw h100-nvlink --seq 4096
  commfuse plan --model 8b --devices 8 --hw h100-hbm2e-500w --seq 8192 --local-batch 2 \
      --ac selective --methods none --layout 1,1,8 --json plan.json
  commfuse plan --model 7b --devices 64 --hw a100-nvlink --batch 256 --micro-batch 2
  commfuse plan --model 70b --devices 1024 --methods commfuse,auto --splits 2
  commfuse plan --model tiny --devices 4 --hw cpu-testbed --inter-hw same --seq 256
  commfuse plan --model mixtral-8x7b --devices 64 --seq 4096 --local-batch 4 --micro-batch 1 \
      --ac full --methods none,commfuse
  commfuse plan --model nemotron-h-8b --devices 8 --seq 8192 --local-batch 2 --micro-batch 1"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commfuse plan", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="70b", choices=sorted(MODELS), metavar="MODEL",
      help=f"model preset, one of {', '.join(sorted(MODELS))}: Llama 2 7B/13B, Llama 3 "
           "8B/70B, Llama 3.2 1B, the CPU-sized tiny/small, MoE Mixtral 8x7B, Qwen3-30B-A3B, "
           "DeepSeek-V2-Lite, hybrid Mamba-2 Nemotron-H 8B (default 70b; shapes and sources "
           "in commfuse/sim/step/ops.py and arch.py)")
    a("--hf-config", default=None, metavar="NAME|PATH",
      help="plan a transformers config instead of --model: a shipped name (mixtral-tiny, "
           "qwen3-moe-tiny, bamba-tiny, mamba2-tiny, llama-tiny, ...: commfuse/data/hf, as "
           "commfuse train --hf-config), a config.json or a directory holding one "
           "(commfuse/sim/plan/hf_config.py)")
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
    a("--local-batch", type=int, default=None,
      help="sequences per DP replica per step (torchtitan's local_batch_size): the global "
           "batch is dp x this, so it differs between layouts (not with --batch)")
    a("--micro-batch", type=int, default=None,
      help="sequences per DP replica per forward/backward; the step runs batch / (dp * "
           "micro-batch) of them (default 1, or the whole --local-batch)")
    a("--ac", default="selective", choices=("none", "selective", "full"),
      help="activation checkpointing per block (default selective: torchtitan's op policy)")
    a("--sharding", default="fsdp", choices=("fsdp", "commfuse"),
      help="how DP shards and gathers: fsdp (torch FSDP2: all parameters sharded, the next "
           "block's gather prefetched, float32 gradient reduce-scatter) or commfuse (this "
           "repository's ZeRO-3, no prefetch) (default fsdp)")
    a("--ops-only", action="store_true",
      help="the GEMMs and collectives only (the planner before the whole-step model)")
    a("--layout", default=None, metavar="TP,UP,DP[,EP]",
      help="time this layout only, e.g. 1,1,8 (an MoE model: 1,1,8,8 for ep=8 over DP "
           "ranks, 2,1,4,tp for the experts over the TP group)")
    a("--ep", type=int, default=None,
      help="MoE models: plan this expert-parallel size only (default: every ep dividing dp "
           "and the experts)")
    a("--json", default=None, metavar="FILE",
      help="also write every plan to FILE as JSON: tp, up, dp, method, step_s, "
           "tokens_per_s_per_device, mfu, peak_memory_gib, fits, tokens_per_step, breakdown")
    a("--methods", default="none,sliced,decompose,commfuse",
      help="comma-separated methods to compare: none, sliced, decompose, commfuse, auto "
           "(auto: per op, the fastest of commfuse.auto's candidates) (default: the four)")
    a("--splits", type=int, default=None,
      help="decompose/commfuse: sub-slices per slice (m; default: decompose 1, commfuse the "
           "cost model's choice per op shape, as method='commfuse' picks it)")
    a("--step", default="current", choices=("current", "previous"),
      help="which training step: current (bucketed grad sync, vocabulary-parallel head, "
           "re-gathering backwards) or previous (before issue #12) (default current)")
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
    import json

    from commfuse.parallel.config import ParallelDims
    from commfuse.sim.step.ops import StepModel, model_config
    from commfuse.sim.plan.ranking import method_options, plan, plan_records, table, train_table
    from commfuse.sim.step.timing import OpTimer, simulate_step
    from commfuse.sim.step.work import TrainSetup

    if a.local_batch is not None and a.batch is not None:
        raise SystemExit("commfuse plan: give --batch or --local-batch, not both")
    only = None
    if a.layout:
        try:
            only = tuple(x if x == "tp" else int(x) for x in a.layout.split(","))
            assert len(only) in (3, 4) and min(x for x in only if x != "tp") >= 1
        except (ValueError, AssertionError):
            raise SystemExit(f"commfuse plan: --layout wants TP,UP,DP[,EP], got {a.layout!r}")
    if a.hf_config:
        from commfuse.sim.plan.hf_config import from_hf

        try:
            base = from_hf(a.hf_config)
        except (ValueError, KeyError) as e:
            raise SystemExit(f"commfuse plan: --hf-config {a.hf_config}: {e}") from e
        a.model = os.path.splitext(os.path.basename(a.hf_config.rstrip("/")))[0]
    cfg = _with_overrides(base if a.hf_config else model_config(a.model), a.set)
    seq = a.seq or min(4096, cfg.max_seq_len)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    inter = None if a.inter_hw == "same" else a.inter_hw
    opts = {"splits": a.splits, "topology": a.topology, "chunks": a.chunks}
    setup = None if a.ops_only else TrainSetup(ac=a.ac, fsdp=a.sharding == "fsdp")
    kw = dict(seq=seq, dtype_bytes=a.dtype_bytes, inter_hw=inter, node_size=a.node_size,
              step_model=StepModel() if a.step == "current" else StepModel.previous())
    t0, timer = time.perf_counter(), OpTimer(a.dtype_bytes)
    plans, rejected = plan(cfg, a.devices, a.hw, methods=methods, method_opts=opts,
                           timer=timer, batch=a.batch, local_batch=a.local_batch,
                           micro_batch=a.micro_batch, setup=setup, only=only, ep=a.ep, **kw)
    elapsed = time.perf_counter() - t0
    batch = f"{a.local_batch} x dp" if a.local_batch else a.batch or a.devices
    print(f"{a.model}{''.join(' ' + x for x in a.set)} ({cfg.n_layers} layers, d={cfg.dim}, "
          f"{cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, ffn {cfg.ffn_hidden}, vocab "
          f"{cfg.vocab_size}{_layers(cfg)}) on {a.devices} x {a.hw}, "
          f"nodes of {a.node_size} linked by {a.inter_hw}; {batch} x {seq} tokens per step, "
          f"micro-batch {a.micro_batch or a.local_batch or 1}"
          + ("" if setup is None else f"; {setup.describe()}"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(plan_records(plans), f, indent=1)
    if not plans:
        print("no valid layout:")
        for *lay, why in rejected:
            print(f"  {_lay(lay)}: {why}")
        return 1
    print((table if setup is None else train_table)(plans, a.top or None))
    best = plans[0]
    mem = "" if setup is None else \
        f", {best.peak_memory_gib:.1f} GiB{'' if best.fits else ' (does not fit)'}"
    print(f"\nbest: {best.name}: {best.step_s:.3f} s per step, "
          f"{best.tokens_per_s_per_device:,.0f} tokens/s per device, MFU "
          f"{100 * best.mfu:.1f} %{mem}, {best.result.micro_batches} micro-batch(es)")
    if rejected:
        print(f"{len(rejected)} layouts rejected, e.g. {_lay(rejected[0][:-1])}: "
              f"{rejected[0][-1]}")
    print(f"{len(plans)} plans timed in {elapsed:.2f} s ({timer.simulations} op simulations)")
    if a.json:
        print(f"wrote {a.json}")
    if a.no_files:
        return 0
    dims = ParallelDims(tp=best.tp, up=best.up, dp=best.dp, method=best.method,
                        method_opts=method_options(best.method, opts), world_size=a.devices)
    r = simulate_step(cfg, dims, a.hw, timeline=True, timer=timer, batch=best.result.tokens
                      // seq, micro_batch=a.micro_batch or a.local_batch or 1, ep=best.ep,
                      ep_axis=best.ep_axis, **kw)
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


def _lay(lay) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(("tp", "up", "dp", "ep"), lay))


def _layers(cfg) -> str:
    """The MoE and Mamba layers of a hybrid config, for the header."""
    from commfuse.sim.step.arch import is_hybrid, sublayers

    if not is_hybrid(cfg):
        return ""
    s, out = sublayers(cfg), []
    if cfg.moe and "E" in s:
        m = cfg.moe
        out.append(f"{s.count('E')} MoE layers of {m.experts} experts top-{m.top_k} ffn "
                   f"{m.expert_ffn}" + (f" + shared {m.shared_ffn}" if m.shared_ffn else ""))
    if "M" in s:
        m = cfg.mamba
        out.append(f"{s.count('M')} Mamba-2 layers ({m.heads} heads of {m.head_dim}, state "
                   f"{m.d_state}, {m.n_groups} groups), {s.count('*')} attention, "
                   f"{s.count('-')} MLP")
    return "; " + "; ".join(out)


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

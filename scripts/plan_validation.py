"""The planner against published runs: docs/planning.md's validation, memory, sensitivity
and AC tables, printed as markdown rows.

    python scripts/plan_validation.py

The rows are torchtitan's Llama 3.1 runs on H100 (`commfuse.sim.plan.published.RUNS`: the 8B
"FSDP" rows of Tables 1 and 3, eager, selective op AC, local batch 2; the 70B 2-D rows of
Table 4, FSDP 32 x TP 8, full AC, local batch 16, with torch.compile and float8 linears),
each predicted by its `commfuse plan` command. Each sensitivity variant changes one
physical figure of the `h100-hbm2e-500w` preset on the 8B rows. Then the MoE rows
(`commfuse.sim.plan.published.MOE_RUNS`: NeMo AutoModel's Qwen3-30B-A3B on 8 H100s, FSDP 8 x EP
8) under each method and AC mode.
"""

from __future__ import annotations

from commfuse import sim
from commfuse.parallel.config import ParallelDims
from commfuse.sim.step.memory import GIB
from commfuse.sim.plan.published import MOE_RUNS, RUNS
from commfuse.sim.step.train import simulate_train_step
from commfuse.sim.step.work import TrainSetup

FSDP_8B = [r for r in RUNS if r.model == "8b"]


PARTS = ("params", "grads", "optimizer", "activations", "gathered weights", "loss",
         "block backward", "op buffers", "allocator reserve")


def predict(run, hw=None, ac: str | None = None, method: str = "none"):
    """The whole step of ``run``'s layout, as its `commfuse plan` command predicts it, or on
    another ``hw``, under another ``ac`` or ``method``."""
    return simulate_train_step(
        run.model, ParallelDims(tp=run.tp, dp=run.dp, method=method, world_size=run.devices),
        hw or run.hw, seq=run.seq, local_batch=run.local_batch, inter_hw="multinode-400g",
        setup=TrainSetup(ac=ac or run.ac), micro_batch=run.micro_batch, ep=run.ep)


def main() -> None:
    base = sim.preset("h100-hbm2e-500w")
    print("| run | published TPS/GPU | predicted | error | published GiB | predicted | error |")
    for run in RUNS:
        r = predict(run)
        tps, gib = r.tokens_per_s_per_device, r.peak_memory_gib
        extra = f" ({', '.join(run.extras)})" if run.extras else ""
        print(f"| {run.name}{extra} | {run.tps_per_gpu:,.0f} | {tps:,.0f} | "
              f"{100 * (tps / run.tps_per_gpu - 1):+.1f} % | {run.memory_gib} | {gib:.1f} | "
              f"{100 * (gib / run.memory_gib - 1):+.1f} % |")
    print("\n| run | " + " | ".join(PARTS) + " | allocated | peak |")
    for run in RUNS[::2]:
        m = predict(run).memory
        cells = [m.parts[k] for k in PARTS] + [m.allocated_bytes, m.peak_bytes]
        print(f"| {run.name} | " + " | ".join(f"{c / GIB:.1f}" for c in cells) + " |")
    variants = {
        "as documented": base,
        "no power limit (700 W)": base.with_(power_limit_w=0.0),
        "memory-bound work at 100 % of 2.4 TB/s": base.with_(mem_efficiency=1.0),
        "memory-bound work at 80 %": base.with_(mem_efficiency=0.8),
        "GEMM ceiling 0.86": base.with_(gemm_max_efficiency=0.86),
        "attention as GEMMs": base.with_(attention_efficiency=(0.0, 0.0)),
    }
    print("\n| variant | 8 GPUs | 128 GPUs |")
    for name, hw in variants.items():
        cells = []
        for run in FSDP_8B:
            t = predict(run, hw).tokens_per_s_per_device
            cells.append(f"{t:,.0f} ({t / run.tps_per_gpu:.2f}x)")
        print(f"| {name} | {' | '.join(cells)} |")
    print("\n| --ac | 8 GPUs | 128 GPUs |")
    for ac in ("none", "selective", "full"):
        cells = []
        for run in FSDP_8B:
            r = predict(run, base, ac)
            cells.append(f"{r.tokens_per_s_per_device:,.0f}, {r.peak_memory_gib:.1f} GiB"
                         + ("" if r.fits else ": does not fit"))
        print(f"| {ac} | {' | '.join(cells)} |")
    r = predict(FSDP_8B[0])
    print("\n8 GPUs, share of the step:",
          {k: f"{100 * v / r.step_s:.1f} %" for k, v in r.breakdown.items()})
    print("8 GPUs, memory GiB:", {k: round(v / 2 ** 30, 2) for k, v in r.memory.parts.items()})

    print("\n| MoE run | published TPS/GPU | --ac | none | commfuse | auto | GiB (none) |")
    for run in MOE_RUNS:
        for ac in ("selective", "full"):
            tps = [predict(run, ac=ac, method=m).tokens_per_s_per_device
                   for m in ("none", "commfuse", "auto")]
            gib = predict(run, ac=ac).peak_memory_gib
            print(f"| {run.name} ({', '.join(run.extras)}) | {run.tps_per_gpu:,.0f} | {ac} | "
                  + " | ".join(f"{t:,.0f} ({100 * (t / run.tps_per_gpu - 1):+.0f} %)"
                               for t in tps) + f" | {gib:.1f} |")


if __name__ == "__main__":
    main()

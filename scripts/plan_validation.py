"""The planner against published runs: docs/planning.md's validation, sensitivity and AC
tables, printed as markdown rows.

    python scripts/plan_validation.py

The rows are torchtitan's Llama 3.1 8B "FSDP" runs (pytorch/torchtitan,
benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3): eager, bf16, selective op AC,
local batch 2, sequence 8192, H100 96 GB HBM2e at 500 W, 400 Gbit/s per GPU between hosts.
Each variant changes one physical figure of the `h100-hbm2e-500w` preset.
"""

from __future__ import annotations

from commfuse import sim
from commfuse.parallel.config import ParallelDims
from commfuse.sim.train_step import simulate_train_step
from commfuse.sim.work import TrainSetup

PUBLISHED = {8: (5762, 82.4), 128: (5605, 67.0)}  # devices: (TPS/GPU, memory GiB)


def predict(devices: int, hw, ac: str = "selective"):
    return simulate_train_step("8b", ParallelDims(dp=devices, method="none", world_size=devices),
                               hw, seq=8192, local_batch=2, inter_hw="multinode-400g",
                               setup=TrainSetup(ac=ac))


def main() -> None:
    base = sim.preset("h100-hbm2e-500w")
    print("| devices | published TPS/GPU | predicted | error | published GiB | predicted | error |")
    for d, (tps, gib) in PUBLISHED.items():
        r = predict(d, base)
        print(f"| {d} | {tps:,} | {r.tokens_per_s_per_device:,.0f} | "
              f"{100 * (r.tokens_per_s_per_device / tps - 1):+.1f} % | {gib} | "
              f"{r.peak_memory_gib:.1f} | {100 * (r.peak_memory_gib / gib - 1):+.1f} % |")
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
        for d, (tps, _) in PUBLISHED.items():
            t = predict(d, hw).tokens_per_s_per_device
            cells.append(f"{t:,.0f} ({t / tps:.2f}x)")
        print(f"| {name} | {' | '.join(cells)} |")
    print("\n| --ac | 8 GPUs | 128 GPUs |")
    for ac in ("none", "selective", "full"):
        cells = []
        for d in PUBLISHED:
            r = predict(d, base, ac)
            cells.append(f"{r.tokens_per_s_per_device:,.0f}, {r.peak_memory_gib:.1f} GiB"
                         + ("" if r.fits else ": does not fit"))
        print(f"| {ac} | {' | '.join(cells)} |")
    r = predict(8, base)
    print("\n8 GPUs, share of the step:",
          {k: f"{100 * v / r.step_s:.1f} %" for k, v in r.breakdown.items()})
    print("8 GPUs, memory GiB:", {k: round(v / 2 ** 30, 2) for k, v in r.memory.parts.items()})


if __name__ == "__main__":
    main()

"""Published training runs that `commfuse plan` is checked against, as data (docs/planning.md
holds the table, tests/test_plan_2d.py the bounds, scripts/plan_validation.py prints them).

    from commfuse.sim.published import RUNS
    for run in RUNS:
        print(run.command(), run.tps_per_gpu, run.memory_gib)

Every row is from torchtitan's benchmark of Llama 3.1 on H100s (pytorch/torchtitan,
benchmarks/llama3_h100_202412_torchtitan.md; torch 1963fc8, torchtitan 9dec370, December
2024): H100 SXM with 96 GB of HBM2e at 2.4 TB/s and a 500 W power limit, eight per host on
NVLink, 400 Gbit/s per GPU between hosts (the `h100-hbm2e-500w` preset with
``--inter-hw multinode-400g``), bf16 mixed precision with float32 master weights, AdamW,
FSDP2, sequence 8192. Memory is torch's ``max_memory_reserved`` (torchtitan's log line),
throughput tokens per second per GPU at step 90.

``extras`` names what a run used that the planner does not model (torch.compile, float8
linears, async TP): the model predicts the same layout in eager bf16 (docs/planning.md says
how each changes a run).
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"


@dataclass(frozen=True)
class PublishedRun:
    """One published row and the `commfuse plan` command that predicts it."""

    name: str
    """Short label (table and test ids)."""
    table: str
    """Where in `SOURCE`: table and row."""
    model: str
    """`commfuse plan --model` preset with the run's shapes."""
    tp: int
    dp: int
    local_batch: int
    """Sequences per DP replica per step (torchtitan's local batch size)."""
    ac: str
    """Activation checkpointing: selective (torchtitan's op policy) or full."""
    tps_per_gpu: float
    memory_gib: float
    extras: tuple[str, ...] = ()
    """Techniques of the run that the planner does not model."""
    seq: int = 8192
    hw: str = "h100-hbm2e-500w"

    @property
    def devices(self) -> int:
        return self.tp * self.dp

    def args(self) -> list[str]:
        """The `commfuse plan` arguments that predict this run (its layout alone)."""
        return ["--model", self.model, "--devices", str(self.devices), "--hw", self.hw,
                "--seq", str(self.seq), "--local-batch", str(self.local_batch), "--ac",
                self.ac, "--methods", "none", "--layout", f"{self.tp},1,{self.dp}"]

    def command(self) -> str:
        return "commfuse plan " + " ".join(self.args())


RUNS = (
    PublishedRun("8B FSDP 8", "Table 1, FSDP", "8b", 1, 8, 2, "selective", 5762, 82.4),
    PublishedRun("8B FSDP 128", "Table 3, FSDP", "8b", 1, 128, 2, "selective", 5605, 67.0),
    PublishedRun("70B FSDP 32 x TP 8", "Table 4, 2D", "70b", 8, 32, 16, "full", 829, 71.9,
                 ("torch.compile", "float8 linears")),
    PublishedRun("70B FSDP 32 x TP 8, async TP", "Table 4, 2D + AsyncTP", "70b", 8, 32, 16,
                 "full", 876, 67.6, ("torch.compile", "float8 linears", "async TP")),
)

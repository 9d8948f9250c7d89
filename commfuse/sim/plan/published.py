"""Published training runs that `commfuse plan` is checked against, as data (docs/planning.md
holds the table, tests/test_plan_2d.py the bounds, scripts/plan_validation.py prints them).

    from commfuse.sim.plan.published import RUNS
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

`MOE_RUNS`: mixture-of-experts rows (`MOE_SOURCE`: NeMo AutoModel's pre-training table,
DGX-H100, BF16, PyTorch backend with FSDP2 and expert parallelism, TransformerEngine and
DeepEP kernels), predicted by their `commfuse plan` command on `h100-nvlink`; the source
gives no memory and no activation-checkpointing setting (the planner's default, selective,
is used). No published training throughput of Mixtral 8x7B in BF16 on H100 nor of
Nemotron-H 8B was found (NeMo's Mixtral rows are FP8 on GB200).
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
MOE_SOURCE = "docs.nvidia.com/nemo/automodel/nightly/performance-summary.html"


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
    memory_gib: float | None
    extras: tuple[str, ...] = ()
    """Techniques of the run that the planner does not model."""
    seq: int = 8192
    hw: str = "h100-hbm2e-500w"
    ep: int = 1
    """Expert-parallel ranks (MoE runs)."""
    micro_batch: int | None = None
    """Sequences per forward/backward (None: the whole local batch)."""

    @property
    def devices(self) -> int:
        return self.tp * self.dp

    def args(self) -> list[str]:
        """The `commfuse plan` arguments that predict this run (its layout alone)."""
        ep = f",{self.ep}" if self.ep > 1 else ""
        mb = ["--micro-batch", str(self.micro_batch)] if self.micro_batch else []
        return ["--model", self.model, "--devices", str(self.devices), "--hw", self.hw,
                "--seq", str(self.seq), "--local-batch", str(self.local_batch), *mb, "--ac",
                self.ac, "--methods", "none", "--layout", f"{self.tp},1,{self.dp}{ep}"]

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

# NeMo AutoModel, "Qwen3 MoE 30B": 8 GPUs, global batch 512, micro-batch 4, local batch 4,
# 16 accumulation steps, sequence 4096, TP 1, PP 1, CP 1, EP 8, FSDP 8, "TE + DeepEP",
# 21.773 s per global step, 277 model TFLOP/s per GPU, 12,040 tokens/s per GPU.
MOE_RUNS = (
    PublishedRun("Qwen3-30B-A3B FSDP 8 x EP 8", "pre-training, DGX-H100 BF16",
                 "qwen3-30b-a3b", 1, 8, 64, "selective", 12040, None,
                 ("TransformerEngine", "DeepEP"), seq=4096, hw="h100-nvlink", ep=8,
                 micro_batch=4),
)

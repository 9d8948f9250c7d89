"""`TrainConfig`: one training run, and the ``commfuse train`` flags that fill it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainConfig:
    """One training run; the fields mirror the ``commfuse train`` flags."""

    tp: int = 1
    """Tensor(+sequence) parallel ranks."""
    up: int = 1
    """Ulysses sequence-parallel ranks (not with tp > 1)."""
    dp: int = 1
    """Sharded data-parallel (ZeRO-3) ranks."""
    method: str = "commfuse"
    """Schedule of every fused op: none, sliced, decompose, commfuse."""
    topology: str = "ring"
    """decompose / commfuse: ring or direct."""
    chunks: int = 4
    """sliced: chunks per op."""
    query_split: bool = False
    """TP attention runs attention + out-projection per query slice inside the RS ring."""
    splits: int = 1
    """decompose / commfuse: sub-slices per rank's slice (m; 4 hid the most in the layer
    benchmarks of docs/benchmarks/2026-11-29.md)."""
    steps: int = 150
    """Optimizer steps of the whole run (a resumed run continues to this step)."""
    seed: int = 0
    """Model init and data order."""
    batch_size: int = 8
    """Global batch (sequences per step), split over the DP ranks."""
    seq_len: int = 128
    """Tokens per sequence (any length: tp / up split it as evenly as it goes)."""
    variable_length: bool = False
    """Step i trains on the first `seq_len_at` (seq_len/2..seq_len) tokens of each sequence,
    so the length, and with it every sequence split, changes from step to step."""
    lr: float = 3e-3
    """Peak learning rate: linear warm-up over steps/20, cosine decay to lr/10 (a function of
    the step, so a resumed run follows the same schedule)."""
    weight_decay: float = 0.1
    """AdamW decay of the matrices (not of norms)."""
    dtype: str = "float32"
    """Parameters and activations (float32 or bfloat16; no float32 master weights)."""
    preset: str = "tiny"
    """A `LlamaConfig.preset` name."""
    model: dict = field(default_factory=dict)
    """LlamaConfig fields overriding the preset."""
    peak_flops: float | None = None
    """Peak FLOP/s of one rank; None: measure a dense matmul at startup."""
    metrics_json: str | None = None
    """Rank 0 writes {config, world, steps: [per-step metrics], summary} here as JSON."""
    checkpoint_dir: str | None = None
    """Where DCP checkpoints go (DIR/step-N, DIR/latest); None: no checkpoints."""
    checkpoint_every: int = 0
    """Save every N steps (0: only at the end / at stop_after)."""
    resume: bool = False
    """Start from DIR/latest (same tp/up/dp and model); from scratch if there is none."""
    stop_after: int | None = None
    """Stop after this step as if interrupted (the LR schedule still spans ``steps``)."""
    exposed_iters: int = 3
    """fwd+bwd pairs (normal / compute_only) timed after training; 0: not measured."""
    progress: bool = True
    """Rank 0 prints a header, progress lines and a summary."""
    timeout: float = 60.0
    """Seconds a rank waits for a peer (every op's ``timeout`` and the process group's) before
    the run fails with an error naming the op, step and peer."""

    @property
    def world(self) -> int:
        return self.tp * self.up * self.dp

    def method_opts(self) -> dict:
        """The method's options among the flags (only those the method accepts)."""
        from commfuse.ops.methods import OPTIONS

        given = {"chunks": self.chunks, "topology": self.topology, "splits": self.splits,
                 "timeout": self.timeout}
        return {k: v for k, v in given.items() if k in OPTIONS[self.method]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``commfuse train`` flags (the lead wires them: ``set_defaults(run=run)``)."""
    a = p.add_argument
    a("--tp", type=int, help="tensor(+sequence) parallel ranks (default 2 if none of "
      "--tp/--up/--dp is given, else 1)")
    a("--up", type=int, help="Ulysses sequence-parallel ranks (default 1; not with --tp > 1)")
    a("--dp", type=int, help="sharded data-parallel (ZeRO-3) ranks (default 1)")
    a("--nproc", type=int, help="local ranks to spawn (default tp*up*dp; ignored under torchrun)")
    a("--method", default="commfuse", choices=["none", "sliced", "decompose", "commfuse", "auto"],
      help="schedule of every fused op (default commfuse)")
    a("--topology", default="ring", choices=["ring", "direct"], help="decompose/commfuse (ring)")
    a("--chunks", type=int, default=4, help="chunks of method sliced (default 4)")
    a("--query-split", action="store_true", help="with --tp: query-split attention (attention "
      "and the out-projection partial per query slice, inside the reduce-scatter ring)")
    a("--splits", type=int, default=1, help="sub-slices per rank's slice for decompose/commfuse "
      "(default 1, the paper's; 4 hid the most communication in our layer benchmarks)")
    a("--steps", type=int, default=150, help="optimizer steps (default 150)")
    a("--seed", type=int, default=0, help="model init and data order (default 0)")
    a("--batch-size", type=int, default=8, help="global batch in sequences (default 8)")
    a("--seq-len", type=int, default=128, help="tokens per sequence (default 128; any length, "
      "split over tp/up as evenly as it goes)")
    a("--variable-length", action="store_true", help="train step i on a prefix of each "
      "sequence whose length varies from step to step (seq-len/2 .. seq-len): every step "
      "splits its sequence differently")
    a("--lr", type=float, default=3e-3, help="peak LR; warm-up steps/20, cosine to lr/10")
    a("--dtype", default="float32", choices=list(DTYPES), help="parameters and activations")
    a("--preset", default="tiny", help="LlamaConfig preset (default tiny)")
    a("--peak-flops", type=float, help="peak FLOP/s of one rank for MFU (default: measured "
      "at startup with a dense 512x512 matmul on each rank, since a CPU core's peak is unknown)")
    a("--metrics-json", metavar="FILE", help="write config, per-step metrics and summary")
    a("--checkpoint-dir", metavar="DIR", help="torch.distributed.checkpoint directory")
    a("--checkpoint-every", type=int, default=0, metavar="N",
      help="save every N steps and at the end (default: only at the end, if --checkpoint-dir)")
    a("--resume", action="store_true", help="continue from DIR/latest (same tp/up/dp)")
    a("--timeout", type=float, default=60.0, metavar="S", help="seconds a rank waits for a "
      "peer before the run fails naming the op, step and peer (default 60)")
    a("--compare-none", action="store_true", help="after the run, re-run the same steps with "
      "--method none (no checkpoints) and print the loss difference and step-time ratio")


def config_from_args(args) -> TrainConfig:
    """The TrainConfig of parsed flags; no --tp/--up/--dp at all means tp=2."""
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"tp", "up", "dp", "model"}
    cfg = TrainConfig(**{n: getattr(args, n) for n in names if hasattr(args, n)})
    cfg.tp = args.tp or (1 if args.up or args.dp else 2)
    cfg.up, cfg.dp = args.up or 1, args.dp or 1
    if args.nproc is not None and args.nproc != cfg.world:
        raise SystemExit(f"commfuse train: --nproc {args.nproc} != tp*up*dp = {cfg.world}")
    return cfg

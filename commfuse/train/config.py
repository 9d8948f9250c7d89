"""`TrainConfig`: one training run, and the ``commfuse train`` flags derived from it.

Each field is a flag (``seq_len`` -> ``--seq-len``) whose type and default are the field's and
whose help is the field's docstring; bools are ``store_true``; a field's metadata (``choices``,
``metavar``) goes to its flag, and ``choices`` are checked in ``__post_init__`` too.
`NOT_FLAGS` names the fields the command line does not set.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import sys
import textwrap
import typing
from dataclasses import dataclass, field

import torch

from commfuse.ops.auto import hardware_choices
from commfuse.ops.methods import OPTIONS
from commfuse.schedule import TOPOLOGIES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainConfig:
    """One training run; each field but `NOT_FLAGS` is a ``commfuse train`` flag."""

    tp: int = 1
    """Tensor(+sequence) parallel ranks."""
    up: int = 1
    """Ulysses sequence-parallel ranks (not with tp > 1)."""
    dp: int = 1
    """Sharded data-parallel (ZeRO-3) ranks."""
    ep: int | None = None
    """Expert-parallel ranks of a mixture-of-experts --hf-config (mixtral-tiny,
    qwen3-moe-tiny, gpt-oss-tiny, ...): each MoE layer's experts are split over them, its
    tokens moved by the dispatch / combine all-to-alls fused with the expert GEMMs
    (`commfuse.tp.experts`). Whole --tp groups: a multiple of --tp that divides tp*dp; more
    than --tp draws them from the --dp ranks (their experts left out of FSDP2). --ep N alone
    sets --tp N (an MoE config splits its experts over the --tp ranks without --ep too)."""
    expert_bias_rate: float = field(default=0.0, metadata={"metavar": "U"})
    """MoE --hf-config whose routers carry a score-correction bias (DeepSeek-V3's
    auxiliary-loss-free balancing): after each step every such bias moves by U toward the
    experts that got fewer tokens than the mean, from the counts over every rank
    (`commfuse.tp.balance`; DeepSeek-V3 used 0.001). 0: the bias stays."""
    moe_seq_aux_coef: float = field(default=0.0, metadata={"metavar": "A"})
    """MoE --hf-config: add A x DeepSeek-V3's sequence-level balance loss, per sequence
    sum_i f_i P_i (f_i: E/(kT) x its tokens routed to expert i, P_i: their mean normalized
    score), averaged over sequences, summed over layers (`commfuse.tp.router_loss`; logged
    as seq_aux). DeepSeek-V3 used 0.0001. 0: off."""
    moe_z_loss_coef: float = field(default=0.0, metadata={"metavar": "B"})
    """MoE --hf-config: add B x the router z-loss (ST-MoE), the mean over tokens of
    logsumexp(router logits)^2, summed over layers (logged as z; ST-MoE used 0.001). 0: off."""
    moe_capacity_factor: float | None = field(default=None, metadata={"metavar": "F"})
    """MoE --hf-config: each expert takes at most ceil(N k / E x F) of the rows of a rank's
    N tokens (its sequence shard), keeping the highest routing weights; the rest are dropped
    (Megatron's capacity factor, "probs" policy: `commfuse.moe.capacity`; the fraction
    logged as dropped). Not given: dropless."""
    method: str = field(default="commfuse", metadata={"choices": tuple(OPTIONS)})
    """Schedule of every fused op (auto: the cost model picks one per op shape)."""
    topology: str = field(default="ring", metadata={"choices": TOPOLOGIES})
    """decompose / commfuse: the peers each slice travels between (ring: the paper's)."""
    chunks: int = 4
    """sliced: chunks per op."""
    query_split: bool = False
    """With tp > 1: attention and the out-projection partial run per query slice, inside the
    reduce-scatter ring (by default only method auto does, where the cost model picks it)."""
    no_query_split: bool = False
    """With tp > 1 and method auto: never query-split attention (by default the cost model
    chooses between it and row-parallel attention per sequence shape)."""
    splits: int | None = None
    """decompose / commfuse: sub-slices per rank's slice (m; 1 is the paper's). Not given
    (None): decompose runs 1, commfuse picks m per op shape on the simulator's cost model of
    the hardware (--hardware)."""
    hardware: str = field(default="measured",
                          metadata={"choices": hardware_choices(), "metavar": "MODEL"})
    """The cost model's hardware, on which auto and commfuse's m choose: measured (the
    device's preset with its GEMM and attention rates fitted at start to kernels timed on
    every rank, commfuse.ops.auto.calibrate) or a preset name (commfuse.sim.hardware.PRESETS,
    e.g. cpu-testbed)."""
    steps: int = 40
    """Optimizer steps of the whole run (a resumed run continues to this step)."""
    seed: int = 0
    """Model init and data order."""
    batch_size: int = 4
    """Global batch (sequences per step), split over the DP ranks."""
    seq_len: int = 1024
    """Tokens per sequence (any length: tp / up split it as evenly as it goes). Attention's
    work per token grows with the length and the bytes the TP collectives move per token do
    not, so at the default the tiny preset's compute per rank is comparable to its
    collectives' time on a 1 Gbit/s link and --compare-none can show the overlap (at 128
    tokens the transfers dominate the step and there is little compute to hide them)."""
    variable_length: bool = False
    """Step i trains on a prefix of each sequence, seq_len/2..seq_len tokens (`seq_len_at`),
    so the length, and with it every sequence split, changes from step to step."""
    lr: float = 3e-3
    """Peak learning rate: linear warm-up over steps/20, cosine decay to lr/10 (a function of
    the step, so a resumed run follows the same schedule)."""
    weight_decay: float = 0.1
    """AdamW decay of the matrices (not of norms)."""
    dtype: str = field(default="float32", metadata={"choices": tuple(DTYPES)})
    """Parameters and activations (no float32 master weights)."""
    preset: str = "tiny"
    """A `LlamaConfig.preset` name: the model."""
    hf_config: str | None = field(default=None, metadata={"metavar": "PATH_OR_NAME"})
    """Train a transformers causal LM built from this config instead (a shipped config's name,
    a config.json or directory, or a hub name), with commfuse.tp over --tp and FSDP2 over --dp
    (`commfuse.train.hf`; needs transformers: pip install 'commfuse[hf]'); if not given
    (None), the preset."""
    model: dict = field(default_factory=dict)
    """LlamaConfig fields overriding the preset."""
    peak_flops: float | None = None
    """Peak FLOP/s of one rank, for MFU; if not given (None), measured at startup with a dense
    512x512 matmul on each rank (a CPU core's peak is unknown)."""
    metrics_json: str | None = field(default=None, metadata={"metavar": "FILE"})
    """Rank 0 writes {config, world, steps: [per-step metrics], summary} here as JSON."""
    checkpoint_dir: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Directory of the torch.distributed.checkpoint saves (DIR/step-N, DIR/latest); if not
    given (None), nothing is saved."""
    checkpoint_every: int = field(default=0, metadata={"metavar": "N"})
    """Save every N steps and at the end (0: only at the end / at stop_after)."""
    resume: bool = False
    """Continue from DIR/latest (same tp/up/dp and model); from scratch if there is none."""
    stop_after: int | None = None
    """Stop after this step as if interrupted (the LR schedule still spans ``steps``)."""
    exposed_iters: int = 3
    """fwd+bwd pairs (normal / compute_only) timed after training; 0: not measured."""
    progress: bool = True
    """Rank 0 prints a header, progress lines and a summary."""
    device: str = field(default="cpu", metadata={"choices": ("cpu", "cuda")})
    """cpu: gloo ranks on CPU cores; cuda: NCCL, one GPU per rank (LOCAL_RANK under torchrun,
    rank i on GPU i when spawned locally), every op on the CUDA stream path."""
    prefetch: int = field(default=1, metadata={"metavar": "N"})
    """With dp > 1: transformer blocks whose ZeRO-3 weight all-gathers are posted ahead of the
    one computing, forward and backward (commfuse.parallel.prefetch); 0 turns prefetch off
    (every weight gathered when used, fused with its GEMM)."""
    prefetch_mb: float | None = field(default=None, metadata={"metavar": "MB"})
    """With prefetch: a limit on the gathered MB posted for blocks ahead; if not given (None),
    only --prefetch bounds them."""
    reduce_in_op: bool = False
    """With prefetch: each ZeRO-3 weight's gradient reduce-scatter runs as the method's fused
    GEMM -> RS, finished in its own backward, instead of being finished during the next
    weight's backward."""
    bucket_mb: float = field(default=25.0, metadata={"metavar": "MB"})
    """Size of the gradient-sync buckets of replicated parameters, each all-reduced as soon as
    the backward has filled it (`commfuse.parallel.grad_sync`)."""
    no_regather_prefetch: bool = False
    """With tp > 1: the backward does not post the AG->GEMM re-gathers ahead (by default each
    is posted from the backward of the GEMM->RS after it, so it moves during the attention /
    SwiGLU backward; `commfuse.ops.prefetch`)."""
    timeout: float = field(default=60.0, metadata={"metavar": "S"})
    """Seconds a rank waits for a peer (every op's timeout and the process group's) before
    the run fails with an error naming the op, step and peer."""

    def __post_init__(self):
        if self.prefetch < 0 or (self.prefetch_mb is not None and self.prefetch_mb < 0):
            raise ValueError(f"TrainConfig.prefetch / prefetch_mb must be >= 0, got "
                             f"{self.prefetch!r} / {self.prefetch_mb!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"TrainConfig.bucket_mb must be positive, got {self.bucket_mb!r}")
        if self.ep is not None and (isinstance(self.ep, bool) or not isinstance(self.ep, int)
                                    or self.ep < 1):
            raise ValueError(f"TrainConfig.ep must be a positive int, got {self.ep!r}")
        if self.ep is not None and self.hf_config is None:
            raise ValueError("--ep takes a mixture-of-experts --hf-config (mixtral-tiny, "
                             "gpt-oss-tiny, deepseek-v3-tiny, ...): the built-in Llama has no "
                             "experts")
        if self.expert_bias_rate < 0 or (self.expert_bias_rate and self.hf_config is None):
            raise ValueError(f"--expert-bias-rate takes a non-negative rate and an MoE "
                             f"--hf-config, got {self.expert_bias_rate!r}")
        for flag, v, least in (("--moe-seq-aux-coef", self.moe_seq_aux_coef, ">= 0"),
                               ("--moe-z-loss-coef", self.moe_z_loss_coef, ">= 0"),
                               ("--moe-capacity-factor", self.moe_capacity_factor, "> 0")):
            ok = v is None or (math.isfinite(v) and (v > 0 or (v == 0 and least == ">= 0")))
            if not ok or (v and self.hf_config is None):
                raise ValueError(f"{flag} takes a finite number {least} and an MoE "
                                 f"--hf-config, got {v!r}")
        if self.query_split and self.no_query_split:
            raise ValueError("--query-split and --no-query-split contradict each other")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"TrainConfig.{f.name} must be one of {list(choices)}, "
                                 f"got {getattr(self, f.name)!r}")

    def device_error(self, local_ranks: int) -> str | None:
        """Why ``device`` cannot run ``local_ranks`` ranks on this machine (None: it can)."""
        if self.device != "cuda":
            return None
        if not torch.cuda.is_available():
            return (f"--device cuda: CUDA is not available (this torch {torch.__version__} "
                    f"{'has no CUDA build' if torch.version.cuda is None else 'sees no GPU'})")
        if torch.cuda.device_count() < local_ranks:
            return (f"--device cuda: {local_ranks} local ranks need one GPU each, "
                    f"{torch.cuda.device_count()} visible (NCCL refuses two ranks on one GPU)")
        return None

    @property
    def world(self) -> int:
        return self.tp * self.up * self.dp

    @property
    def consults_cost_model(self) -> bool:
        """Whether the run's ops ask the hardware model (`commfuse.ops.auto`): auto picks
        each op's method and query-split attention by it, commfuse without --splits its m;
        the other methods run fixed schedules."""
        return self.method == "auto" or (self.method == "commfuse" and self.splits is None)

    def method_opts(self) -> dict:
        """The method's options among the flags (only those the method accepts)."""
        given = {"chunks": self.chunks, "topology": self.topology, "splits": self.splits,
                 "timeout": self.timeout}
        return {k: v for k, v in given.items() if k in OPTIONS[self.method] and v is not None}


# Fields without a flag: model (a dict of LlamaConfig overrides; --preset names the model),
# stop_after (a simulated interruption, for the resume tests), exposed_iters, progress (True
# by default, so no store_true) and weight_decay (part of the fixed recipe, like the betas):
# settings of the job when it is called from Python, as tests/test_train.py does.
NOT_FLAGS = frozenset({"model", "stop_after", "exposed_iters", "progress", "weight_decay"})
LAYOUT = ("tp", "up", "dp")  # flags default to None: none given means tp=2 (config_from_args)


def field_docs(cls) -> dict[str, str]:
    """Each dataclass field's docstring (the string below it in the class body), whitespace
    collapsed; {} when the source is not available."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):
        return {}
    return {a.target.id: " ".join(d.value.value.split()) for a, d in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(d, ast.Expr) and isinstance(d.value, ast.Constant)
            and isinstance(d.value.value, str)}


def shipped_hf_configs() -> list[str]:
    """The names --hf-config takes for the configs shipped in commfuse/data/hf/."""
    from commfuse.data import DATA_DIR

    return sorted(p.stem for p in (DATA_DIR / "hf").glob("*.json"))


def _flag(f: dataclasses.Field, kind: type, doc: str) -> dict:
    """The ``add_argument`` keywords of one field."""
    if f.name == "hf_config":  # the shipped names as they are on disk
        doc = f"{doc.rstrip('.')}. Shipped: {', '.join(shipped_hf_configs())}."
    default = None if f.name in LAYOUT else f.default
    shown = ("2 if none of --tp/--up/--dp is given, else 1" if f.name == "tp"
             else f.default if f.default is not None and f.default is not False else None)
    doc = doc.replace("`", "").replace("%", "%%")
    kw = {"help": doc if shown is None else f"{doc.rstrip('.')} (default: {shown})"}
    if kind is bool:
        if f.default is not False:
            raise TypeError(f"TrainConfig.{f.name}: a bool flag must default to False")
        return {**kw, "action": "store_true"}
    return {**kw, "type": kind, "default": default, **f.metadata}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``commfuse train`` flags (the lead wires them: ``set_defaults(run=run)``): one per
    TrainConfig field but `NOT_FLAGS`, then --nproc and --compare-none."""
    hints, docs = typing.get_type_hints(TrainConfig), field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name not in NOT_FLAGS:
            kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                        if t is not type(None))
            p.add_argument("--" + f.name.replace("_", "-"), **_flag(f, kind, docs.get(f.name, "")))
    p.add_argument("--nproc", type=int, help="Local ranks to spawn (default: tp*up*dp); 1 runs "
                   "one unsharded process here, ignoring --tp/--up/--dp (with a note); ignored "
                   "under torchrun")
    p.add_argument("--link", default="auto", metavar="RATE", help="The local ranks' network: "
                   "auto (as root with iproute2: every rank in its own network namespace on a "
                   "shaped 1gbit link, one core each, as `commfuse launch` runs them, so step "
                   "times show the overlap; otherwise loopback, saying so), loopback (shared "
                   "cores, as fast as memcpy: shows no overlap) or a tc rate such as 200mbit "
                   "(default: auto; ignored under torchrun and with --device cuda)")
    p.add_argument("--compare-none", action="store_true", help="Also train the same model "
                   "with --method none on the same ranks and batches, the two models' steps in "
                   "turn (with --hf-config: a second run afterwards; none saves no checkpoint), "
                   "and print the loss difference, the step-time ratio (the median of each "
                   "step's) and a one-line verdict: how much faster, how much of none's exposed "
                   "communication was hidden, whether the losses agree, or why the ratio "
                   "cannot show overlap (loopback); --metrics-json gets it as compare_none")


def config_from_args(args) -> TrainConfig:
    """The TrainConfig of parsed flags; no --tp/--up/--dp at all means tp=2; ``--nproc 1`` means
    one unsharded process (tp = up = dp = 1, saying so on stderr if a layout was asked for)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)} - NOT_FLAGS - set(LAYOUT)
    cfg = TrainConfig(**{n: getattr(args, n) for n in names if hasattr(args, n)})
    cfg.tp = args.tp or (1 if args.up or args.dp else cfg.ep or 2)
    cfg.up, cfg.dp = args.up or 1, args.dp or 1
    if args.nproc == 1 and cfg.world != 1:
        print(f"commfuse train: --nproc 1: one unsharded process (ignoring tp={cfg.tp} "
              f"up={cfg.up} dp={cfg.dp})", file=sys.stderr)
        cfg.tp = cfg.up = cfg.dp = 1
        cfg.ep = None
    if cfg.ep is not None and (cfg.ep % cfg.tp or (cfg.tp * cfg.dp) % cfg.ep):
        raise SystemExit(f"commfuse train: --ep {cfg.ep} must be a multiple of --tp {cfg.tp} "
                         f"that divides tp*dp = {cfg.tp * cfg.dp} (each expert group is whole "
                         f"tp groups)")
    if args.nproc is not None and args.nproc != cfg.world:
        raise SystemExit(f"commfuse train: --nproc {args.nproc} != tp*up*dp = {cfg.world}")
    return cfg

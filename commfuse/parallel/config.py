"""How a model is split: the parallel dimensions (a validated dataclass) and their process groups.

Importable without torch (the planner validates layouts with `ParallelDims`); torch.distributed
is imported only where process groups are made or read.

`ParallelDims` says how many ranks each axis has and which fused-op method every op uses;
`ParallelDims.build_mesh()` creates the process groups (explicitly, with `dist.new_group`) and
returns a `Mesh`, which the plans in this package take as an argument. Nothing is global.

Rank layout (a 2-D mesh): ``rank = dp_index * inner + inner_index``, where the inner axis is
the sequence-sharding one (TP or UP, at most one of them > 1). So the ranks of one TP/UP
group are neighbours (the ones that talk every layer), the DP groups stride across them.

Axis names (mesh axes, not tensor dims): "tp", "up", "dp"; "seq" is whichever of tp/up shards
the sequence between blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from commfuse.ops.methods import method_spec

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass
class ParallelDims:
    tp: int = 1
    """Tensor(+sequence) parallel ranks (Megatron TPSP): heads and FFN columns are sharded."""
    up: int = 1
    """Ulysses sequence-parallel ranks: the sequence is sharded, attention runs on all of it
    for 1/up of the heads. Not combinable with tp > 1."""
    dp: int = 1
    """Data-parallel ranks, ZeRO-3 style: every Linear weight is sharded by rows."""
    method: str = "commfuse"
    """The fused-op method used by every op: "none", "sliced", "decompose" or "commfuse"."""
    method_opts: dict = field(default_factory=dict)
    """Options of that method, passed to every op: topology ("ring" | "direct"), chunks, timeout."""
    query_split: bool | None = None
    """Query-split TP attention: attention and the out-projection partial run per query slice
    inside the reduce-scatter ring (`commfuse.ops.attention`); needs tp > 1. None (default):
    under method "auto" the cost model decides per sequence shape
    (`commfuse.ops.auto.choose_query_split`), otherwise row-parallel; False: never."""
    world_size: int | None = None
    """Ranks in the job. None: torch.distributed's world size if initialised, else tp*up*dp."""
    prefetch: int = 1
    """With dp > 1: transformer blocks whose weight all-gathers are posted ahead of the one
    computing (forward: the next ones; backward: the previous ones), consumed by their GEMMs
    as they arrive (`commfuse.parallel.prefetch`); 0: none, every weight gathered when used,
    fused with its GEMM."""
    prefetch_mb: float | None = None
    """With prefetch: a limit on the gathered MB posted for blocks ahead (the blocks posted
    stop at the first that would pass it); None: only ``prefetch`` bounds them."""
    defer_reduce: bool = True
    """With prefetch: each ZeRO-3 weight's gradient reduce-scatter is posted in its backward
    and finished during the next weight's (all by the end of the backward), so it overlaps
    the backward before it; False: the method's fused GEMM -> RS, finished in its own."""
    regather_prefetch: int = 1
    """TP: the backward posts each AG->GEMM's re-gather ahead, from the backward of the
    GEMM->RS after it, so it moves during the attention / SwiGLU backward
    (`commfuse.ops.prefetch`); at most this many posted ahead at once; 0: off."""

    def __post_init__(self):
        for name in ("tp", "up", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive int, got {v!r}")
        if self.tp > 1 and self.up > 1:
            raise ValueError(f"tp={self.tp} together with up={self.up} is not supported: TPSP and "
                             "Ulysses both shard the sequence between blocks; use one of them "
                             "(optionally with dp)")
        if not isinstance(self.method_opts, dict):
            raise ValueError(f"ParallelDims.method_opts must be a dict, got {self.method_opts!r}")
        method_spec(self.method, self.method_opts)  # ValueError on bad method/options
        p = self.regather_prefetch
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ValueError(f"ParallelDims.regather_prefetch must be an int >= 0, got {p!r}")
        if self.query_split not in (None, True, False):
            raise ValueError(f"ParallelDims.query_split must be None, True or False, got "
                             f"{self.query_split!r}")
        if self.query_split and self.tp == 1:
            raise ValueError("query_split=True needs tp > 1: it is a TP attention schedule")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) \
                or self.prefetch < 0:
            raise ValueError(f"ParallelDims.prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.prefetch_mb is not None and not (isinstance(self.prefetch_mb, (int, float))
                                                 and self.prefetch_mb >= 0):
            raise ValueError(f"ParallelDims.prefetch_mb must be >= 0 or None, "
                             f"got {self.prefetch_mb!r}")
        if self.world_size is None:
            self.world_size = _initialised_world() or self.tp * self.up * self.dp
        if self.tp * self.up * self.dp != self.world_size:
            raise ValueError(f"tp*up*dp = {self.tp}*{self.up}*{self.dp} = "
                             f"{self.tp * self.up * self.dp} must equal the world size "
                             f"({self.world_size})")

    @property
    def seq(self) -> int:
        """Ranks sharing one sequence (the TP or UP group size)."""
        return self.tp * self.up

    @property
    def op_kwargs(self) -> dict:
        """Keyword arguments for every fused op: method=..., **method_opts."""
        return {"method": self.method, **self.method_opts}

    def check_model(self, cfg, seq_len: int | None = None, batch_size: int | None = None):
        """ValueError if LlamaConfig ``cfg`` (and the global batch / sequence) cannot be split."""
        need = []
        if self.tp > 1:
            need += [("n_heads", cfg.n_heads, self.tp), ("n_kv_heads", cfg.n_kv_heads, self.tp),
                     ("ffn_hidden", cfg.ffn_hidden, self.tp)]
        if self.up > 1:
            need += [("n_heads", cfg.n_heads, self.up), ("n_kv_heads", cfg.n_kv_heads, self.up)]
        if self.seq > 1:  # vocabulary-parallel embedding and head (commfuse.parallel.vocab)
            need.append(("vocab_size", cfg.vocab_size, self.seq))
        if seq_len is not None:  # any length: the sequence is split as evenly as it goes
            if seq_len > cfg.max_seq_len:
                raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={cfg.max_seq_len}")
        if batch_size is not None:
            need.append(("global batch size", batch_size, self.dp))
        if self.dp > 1:  # rows of every DP-sharded weight (after TP sharding)
            hd, t = cfg.head_dim, self.tp
            rows = {"wq": cfg.n_heads * hd // t, "wk/wv": cfg.n_kv_heads * hd // t,
                    "wo": cfg.dim, "w_gate/w_up": cfg.ffn_hidden // t, "w_down": cfg.dim}
            if self.up > 1:
                rows = {"wqkv (q|k|v)": (cfg.n_heads + 2 * cfg.n_kv_heads) * hd,
                        "wo": cfg.dim, "w_gate/w_up": cfg.ffn_hidden, "w_down": cfg.dim}
            if not cfg.tie_embeddings and self.seq == 1:  # under TP/UP: sharded if divisible
                rows["output"] = cfg.vocab_size
            need += [(f"rows of {k} (per TP rank)" if t > 1 else f"rows of {k}", v, self.dp)
                     for k, v in rows.items()]
        for what, size, ranks in need:
            if size % ranks:
                raise ValueError(f"{what} ({size}) must be divisible by {ranks} "
                                 f"(ParallelDims tp={self.tp} up={self.up} dp={self.dp})")

    def build_mesh(self) -> Mesh:
        """Create the groups of this layout; every rank must call it, in the same order."""
        import torch.distributed as dist

        from commfuse.runtime.gloo import duplex

        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs torch.distributed initialised")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != self.world_size:
            raise ValueError(f"ParallelDims was validated for world size {self.world_size}, "
                             f"but torch.distributed has {world} ranks")
        inner = self.seq
        dp_index, inner_index = divmod(rank, inner)
        seq_group = dp_group = None
        # every rank creates every group, in the same order (new_group is collective)
        opts = None
        if dist.get_backend() == "nccl":  # high-priority NCCL streams, as the default group's
            from commfuse.runtime.cuda import comm_options  # CUDA-only code, imported lazily

            opts = comm_options("nccl")
        for d in range(self.dp):
            ranks = [d * inner + i for i in range(inner)]
            g = dist.new_group(ranks, pg_options=opts) if inner > 1 else None
            if d == dp_index:
                seq_group = g
        for i in range(inner):
            ranks = [d * inner + i for d in range(self.dp)]
            g = dist.new_group(ranks, pg_options=opts) if self.dp > 1 else None
            if i == inner_index:
                dp_group = g
        for g in (seq_group, dp_group):  # members only, in the same order on every rank
            if g is not None:
                duplex(g)
        return Mesh(self, rank, world, dp_index, inner_index, seq_group, dp_group,
                    dist.group.WORLD)


def _initialised_world() -> int | None:
    """torch.distributed's world size when a process group exists (and torch is installed)."""
    try:
        import torch.distributed as dist
    except ImportError:  # the planner without torch
        return None
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


@dataclass
class Mesh:
    """This rank's place in a `ParallelDims` layout and its process groups (None: size 1)."""

    dims: ParallelDims
    rank: int
    world: int
    dp_index: int
    """This rank's index in its DP group (which slice of the global batch it reads)."""
    seq_index: int
    """This rank's index in its TP/UP group (which sequence shard it holds)."""
    seq_group: dist.ProcessGroup | None
    """The TP or UP group (the ranks sharing one sequence); None if tp = up = 1."""
    dp_group: dist.ProcessGroup | None
    """The DP group (same seq_index, different batches); None if dp = 1."""
    world_group: dist.ProcessGroup | None
    """All ranks (loss normalisation)."""

    @property
    def tp_group(self):
        return self.seq_group if self.dims.tp > 1 else None

    @property
    def up_group(self):
        return self.seq_group if self.dims.up > 1 else None


# --- which mesh axes a parameter is sharded over -----------------------------------------------

def mark_sharded(param, *axes: str):
    """Record that ``param`` holds a shard over mesh axes ``axes`` ("seq", "dp")."""
    param.commfuse_sharded = tuple(sorted(set(getattr(param, "commfuse_sharded", ())) | set(axes)))
    return param


def sharded_axes(param) -> tuple[str, ...]:
    """The mesh axes ``param`` is sharded over; its gradient is summed over the others."""
    return getattr(param, "commfuse_sharded", ())

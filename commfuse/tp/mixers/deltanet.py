"""TPSP for Gated DeltaNet mixers (the linear attention of Qwen3.5 and Qwen3-Next):
`DeltaNetParallel`, a ParallelStyle that the derived plan (`commfuse.tp.plan`) puts on every
module `is_gated_deltanet` recognises.

A Gated DeltaNet mixer with Hk key heads of dk and Hv value heads of dv (each key head read by
Hv/Hk consecutive value heads) is

    in_proj   q, k: Hk dk; v, z: Hv dv; b, a: Hv         = h @ W^T (one or more linears)
    conv1d    causal depthwise conv over the q | k | v channels, then silu
    rule      the gated delta rule, local per value head over the whole sequence:
              beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
    norm      per value head: RMSNorm(y) * weight * silu(z)
    out_proj  h' = y @ W_out^T

Qwen3.5's in_proj is four linears (``in_proj_qkv`` [q|k|v], ``in_proj_z``, ``in_proj_b``,
``in_proj_a``); Qwen3-Next packs them per key head (``in_proj_qkvz``: for each key head its q,
k, v and z rows; ``in_proj_ba``: its b and a rows), `LAYOUTS`.

On T ranks rank r owns value heads [r Hv/T, (r+1) Hv/T): their v, z, b, a rows, A_log and
dt_bias; and the key heads they read: Hk/T of them, or, when Hk < T, the one key head, its
q/k rows replicated on the T/Hk ranks that share it (as kv heads are). Under sequence
parallelism that is one AG->GEMM (`fused_all_gather_matmul` over every in_proj linear: the
sequence shard in, this rank's q|k|v|z|b|a of the whole sequence out), the conv, the rule and
the norm on local channels and heads, and one GEMM->RS (out_proj as `FusedRowwiseParallel`).

This rank's rows of each in_proj linear and its conv1d channels are not one contiguous block
of the model's weight, so those parameters are DTensors ``Shard(0)`` of the *assembled*
weight: every rank's rows in rank order (q_r, k_r, v_r, z_r, b_r, a_r as far as the linear
holds them), q/k rows repeated where they are replicated. Their ``full_tensor()`` is that
assembled weight; `commfuse.tp.attention.unpack_rows` with the module's ``_commfuse_rows``
maps it back to the model's layout. A replicated row's gradient is summed over the ranks
that share it, so its copies stay equal. A_log and dt_bias are ``Shard(0)`` in the model's
layout; the norm's weight (one per head dim, shared by every head) is the plan's
`SequenceParallelNorm`: replicated, its gradient summed over TP.

The conv and the rule are the model module's own torch functions (``causal_conv1d_forward``,
``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``) on this rank's
channels and heads. With a generation cache (transformers' lazily allocated linear-attention
layers, shaped by what is first written) the cache therefore holds this rank's conv channels
q_r | k_r | v_r and the recurrent states of its value heads: a prefill on the
sequence-sharded path writes them from the whole sequence (the chunked rule's final state), a
decode step (fewer tokens than ranks, no gradients: ``SeqSplit.replicated``) is the recurrent
rule's single step from them, in_proj local GEMMs and out_proj a local GEMM closed by an
all-reduce. A cache that records past states (assisted generation) is refused.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.nn import functional as F

from commfuse.ops.fused import fused_all_gather_matmul
from commfuse.tp.mixers import assemble
from commfuse.tp.functional import sum_grad
from commfuse.tp.sequence import _mesh_group, _param
from commfuse.tp.style import _Fused

PARTS = "qkvzba"  # the in_proj outputs, in the order this rank's rows are assembled
# in_proj linears -> the parts each holds; packed: each linear's rows grouped per key head
LAYOUTS = {"separate": ((("in_proj_qkv", "qkv"), ("in_proj_z", "z"), ("in_proj_b", "b"),
                         ("in_proj_a", "a")), False),
           "per key head": ((("in_proj_qkvz", "qkvz"), ("in_proj_ba", "ba")), True)}
COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")
HEADS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


@dataclass(frozen=True)
class DeltaNetLayout:
    """Which rows of a Gated DeltaNet's in_proj linears and conv1d each of ``world`` ranks
    owns: ``k_heads`` of ``k_dim``, ``v_heads`` of ``v_dim``; ``linears``: (name, parts) of
    the in_proj linears; ``packed``: their rows grouped per key head (Qwen3-Next)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    world: int
    linears: tuple[tuple[str, str], ...] = LAYOUTS["separate"][0]
    packed: bool = False

    @property
    def replicas(self) -> int:
        """Ranks that hold each key head (1 when Hk >= T)."""
        return max(self.world // self.k_heads, 1)

    @property
    def local_k_heads(self) -> int:
        return max(self.k_heads // self.world, 1)

    @property
    def local_v_heads(self) -> int:
        return self.v_heads // self.world

    def _span(self, part: str) -> tuple[int, int]:
        """(heads, width per head) of ``part``."""
        if part in "qk":
            return self.k_heads, self.k_dim
        return self.v_heads, self.v_dim if part in "vz" else 1

    def width(self, parts: str) -> int:
        """The model's rows of ``parts`` (all heads)."""
        return sum(h * d for h, d in map(self._span, parts))

    def local_sizes(self, parts: str = PARTS) -> list[int]:
        """Each part's width on one rank."""
        return [(self.local_k_heads if p in "qk" else self.local_v_heads) * self._span(p)[1]
                for p in parts]

    def part_rows(self, part: str, r: int) -> torch.Tensor:
        """Rank r's rows of ``part`` (head-major, as the model's split of it)."""
        _, d = self._span(part)
        n = self.local_k_heads if part in "qk" else self.local_v_heads
        first = (r // self.replicas if part in "qk" else r) * n
        return torch.arange(first * d, (first + n) * d)

    def _maps(self, parts: str, packed: bool) -> dict[str, torch.Tensor]:
        """part -> the model rows of a linear holding ``parts`` (in that order, whole, or per
        key head when ``packed``) that hold the part's rows, in the part's order."""
        sizes = [self.width(p) for p in parts]
        rows = torch.arange(sum(sizes))
        if packed:  # each key head's slice of every part, then the next key head's
            per = rows.reshape(self.k_heads, -1).split([s // self.k_heads for s in sizes], 1)
        else:
            per = rows.split(sizes)
        return {p: t.flatten() for p, t in zip(parts, per)}

    def rows(self, parts: str, r: int | None = None, packed: bool | None = None) -> torch.Tensor:
        """Rank r's rows of the linear holding ``parts``, in the model's layout (every rank's,
        concatenated, when r is None)."""
        if r is None:
            return torch.cat([self.rows(parts, q, packed) for q in range(self.world)])
        maps = self._maps(parts, self.packed if packed is None else packed)
        return torch.cat([maps[p][self.part_rows(p, r)] for p in parts])

    def conv_rows(self, r: int | None = None) -> torch.Tensor:
        """Rank r's conv1d channels in the model's layout: q_r, k_r, v_r."""
        return self.rows("qkv", r, packed=False)

    def shared_rows(self, parts: str) -> int:
        """How many leading rows of a rank's share of the linear holding ``parts`` are
        replicated (its q and k rows when Hk < T)."""
        if self.replicas == 1:
            return 0
        return sum(n for p, n in zip(parts, self.local_sizes(parts)) if p in "qk")


def is_gated_deltanet(module: nn.Module) -> bool:
    """Whether ``module`` is a Gated DeltaNet mixer: a conv1d, A_log, dt_bias, a norm,
    out_proj and the in_proj linears of one of `LAYOUTS`."""
    return all(hasattr(module, n) for n in COMMON) and any(
        all(isinstance(getattr(module, n, None), nn.Linear) for n, _ in lins)
        for lins, _ in LAYOUTS.values())


def deltanet_layout(mixer: nn.Module, T: int, where: str = "mixer") -> DeltaNetLayout:
    """The mixer's `DeltaNetLayout` on ``T`` ranks; ValueError naming ``where`` and what is
    missing, what does not match or what does not divide."""
    kind = type(mixer).__name__
    found = [(lins, packed) for lins, packed in LAYOUTS.values()
             if all(isinstance(getattr(mixer, n, None), nn.Linear) for n, _ in lins)]
    bad = [n for n in HEADS if not isinstance(getattr(mixer, n, None), int)]
    bad += [] if isinstance(getattr(mixer, "activation", None), str) else ["activation"]
    if not found or bad:
        raise ValueError(f"{where} ({kind}) is not a Gated DeltaNet mixer: missing "
                         f"{', '.join(bad) or 'its in_proj linears'}")
    (lins, packed), = found
    Hk, Hv, dk, dv = (getattr(mixer, n) for n in HEADS)
    lay = DeltaNetLayout(Hk, Hv, dk, dv, T, lins, packed)
    wrong = [f"{n} of {getattr(mixer, n).out_features} rows (want {lay.width(p)}: "
             f"{'|'.join(p)})" for n, p in lins if getattr(mixer, n).out_features != lay.width(p)]
    conv, norm = mixer.conv1d, mixer.norm
    if not isinstance(conv, nn.Conv1d) or conv.in_channels != 2 * Hk * dk + Hv * dv \
            or conv.groups != conv.in_channels:
        wrong.append(f"conv1d (a depthwise Conv1d over {2 * Hk * dk + Hv * dv} channels)")
    for n in ("A_log", "dt_bias"):
        if tuple(getattr(mixer, n).shape) != (Hv,):
            wrong.append(f"{n} (one per value head: {Hv})")
    if sorted(n for n, _ in norm.named_parameters()) != ["weight"] or \
            tuple(norm.weight.shape) != (dv,):
        wrong.append(f"norm (a gated norm with one weight of head_v_dim {dv})")
    if not isinstance(mixer.out_proj, nn.Linear) or mixer.out_proj.in_features != Hv * dv:
        wrong.append(f"out_proj (an nn.Linear from {Hv * dv})")
    known = {"A_log", "dt_bias", "conv1d.weight", "conv1d.bias", "norm.weight",
             "out_proj.weight", "out_proj.bias",
             *(f"{n}.{p}" for n, _ in lins for p in ("weight", "bias"))}
    extra = sorted(set(n for n, _ in mixer.named_parameters()) - known)
    if extra:
        wrong.append(f"parameters {extra} that no style covers")
    if wrong:
        raise ValueError(f"{where} ({kind}): a Gated DeltaNet mixer with {'; '.join(wrong)}")
    if Hv % Hk:
        raise ValueError(f"{where}: num_v_heads ({Hv}) must be divisible by num_k_heads ({Hk})")
    if Hv % T:
        raise ValueError(f"{where}: num_v_heads ({Hv}) must be divisible by the TP size ({T}) "
                         f"(each rank owns whole value heads)")
    if Hk % T and T % Hk:
        raise ValueError(f"{where}: num_k_heads ({Hk}) and the TP size ({T}) must divide one "
                         f"another (key heads are split, or replicated when fewer than ranks)")
    return lay


class DeltaNetParallel(_Fused):
    """On a Gated DeltaNet mixer: its in_proj linears and conv1d as assembled ``Shard(0)``
    DTensors (``_commfuse_rows`` on each), A_log and dt_bias ``Shard(0)``; its forward
    becomes the sequence-parallel one (the module docstring). The plan gives out_proj
    `FusedRowwiseParallel` and the norm `SequenceParallelNorm`. ``save_gathered``: as for
    `FusedColwiseParallel`."""

    def __init__(self, *, save_gathered: bool = False, **kw):
        super().__init__(**kw)
        self.op_kwargs["save_gathered"] = save_gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_group(device_mesh)
        lay = deltanet_layout(module, device_mesh.size())
        rows = {name: lay.rows(parts) for name, parts in lay.linears}
        rows["conv1d"] = lay.conv_rows()
        assemble(module, rows, device_mesh)
        for name in ("A_log", "dt_bias"):
            p = getattr(module, name)
            module.register_parameter(name, _param(p, device_mesh, Shard(0), p.requires_grad))
        module._commfuse_deltanet = lay
        return self._install(module, device_mesh, self._forward)

    @staticmethod
    def _local(p: torch.Tensor | None, shared: int, lay: DeltaNetLayout, group):
        """This rank's part of an assembled parameter, its first ``shared`` rows (replicated
        q/k) entering through `sum_grad` over the ranks that share them."""
        if p is None:
            return None
        t = p.to_local()
        if not shared:
            return t
        slot, slots = group.rank() // lay.replicas, group.size() // lay.replicas
        return torch.cat([sum_grad(t[:shared], group, slot, slots), t[shared:]])

    def _forward(self, mixer: nn.Module, group, hidden_states: torch.Tensor, cache=None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        lay: DeltaNetLayout = mixer._commfuse_deltanet
        code = sys.modules[type(mixer).__module__]  # the model's own conv and rule functions
        replicated = self.split is not None and self.split.replicated
        state = None
        if cache is not None:
            if cache.get_recurrent_states_to_keep(mixer.layer_idx):
                raise ValueError("commfuse.tp's Gated DeltaNet mixer does not record past "
                                 "recurrent states (assisted generation's cache)")
            state = cache.get_recurrent_state(mixer.layer_idx, state_idx=0)
        if attention_mask is not None:  # padding: zero this rank's rows of the input
            if not replicated:
                sizes = self.sizes or (hidden_states.shape[self.dim],) * group.size()
                off = sum(sizes[:group.rank()])
                attention_mask = attention_mask[:, off:off + sizes[group.rank()]]
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        # 1. in_proj: AG -> GEMM over every linear, this rank's q|k|v|z|b|a of the sequence
        ws, bs = [], []
        for name, parts in lay.linears:
            lin = getattr(mixer, name)
            ws.append(self._local(lin.weight, lay.shared_rows(parts), lay, group).t())
            bs.append(self._local(lin.bias, lay.shared_rows(parts), lay, group))
        if replicated:  # every token here (a decode step): local GEMMs
            ys = [hidden_states @ w for w in ws]
        else:
            _, ys = fused_all_gather_matmul(hidden_states, ws, self.dim, group, return_A=False,
                                            sizes=self.sizes, prefetch=self.prefetch,
                                            **self.op_kwargs)
        y = torch.cat([y if b is None else y + b for y, b in zip(ys, bs)], -1)
        q, k, v, z, b, a = y.split(lay.local_sizes(), -1)
        # 2. causal depthwise conv over this rank's q | k | v channels (the cache's conv state:
        # these channels' last inputs)
        n = lay.shared_rows("qkv")
        conv = SimpleNamespace(weight=self._local(mixer.conv1d.weight, n, lay, group),
                               bias=self._local(mixer.conv1d.bias, n, lay, group),
                               kernel_size=mixer.conv1d.kernel_size)
        qkv = code.causal_conv1d_forward(conv, torch.cat([q, k, v], -1).transpose(1, 2), cache,
                                         mixer.layer_idx,
                                         activation=mixer.activation).transpose(1, 2)
        q, k, v = qkv.split(lay.local_sizes("qkv"), -1)
        # 3. the gated delta rule, local per value head, over the whole sequence (chunked), or
        # one step from the cache's recurrent state of this rank's heads
        B, S = q.shape[:2]
        g = -mixer.A_log.to_local().float().exp() * F.softplus(
            a.float() + mixer.dt_bias.to_local())
        rule = code.torch_recurrent_gated_delta_rule if state is not None and S == 1 else \
            code.torch_chunk_gated_delta_rule
        out, state = rule(
            q.reshape(B, S, -1, lay.k_dim), k.reshape(B, S, -1, lay.k_dim),
            v.reshape(B, S, -1, lay.v_dim), g=g, beta=b.sigmoid(), initial_state=state,
            output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)
        if cache is not None:
            cache.update_recurrent_state(state, mixer.layer_idx)
        # 4. the gated norm per head, 5. out_proj: GEMM -> RS (FusedRowwiseParallel), or a
        # local GEMM and an all-reduce on a replicated split
        out = mixer.norm(out.reshape(-1, lay.v_dim), z.reshape(-1, lay.v_dim))
        return mixer.out_proj(out.reshape(B, S, -1))

"""TPSP for Mamba-2 mixers: `MambaMixerParallel`, a ParallelStyle that `commfuse.tp.plan`'s
derived plan sets on every module `is_mamba2` recognises by its parts.

A Mamba-2 mixer (transformers' Mamba2Mixer, BambaMixer, NemotronHMamba2Mixer,
GraniteMoeHybridMambaLayer, FalconH1Mixer) is

    in_proj   [z | x | B | C | dt] = h @ W_in^T      z, x: d_inner; B, C: G*N; dt: H
    conv1d    causal depthwise conv over the x | B | C channels, then silu
    scan      the selective scan (SSD), local per head, over the whole sequence
    norm      y * silu(z), RMS-normalised per group of d_inner / G channels, times a weight
    out_proj  h' = y @ W_out^T

Falcon-H1's mixer adds a scalar ``ssm_in_multiplier`` on h, a ``mup_vector`` buffer
multiplying in_proj's output rows (split with the rows: each rank multiplies its own), and
its norm may normalise before the gate (``norm_before_gate``) or be absent (``nn.Identity``:
y * silu(z)); the forward reads each of these where the mixer has it.

On T ranks (Megatron's split), rank r owns heads [r H/T, (r+1) H/T): their z, x and dt, the
d_inner/T channels of y, A_log, D, dt_bias and the gated norm's weight; and the B/C groups of
those heads: G/T groups, or, when G < T, the one group its heads read, replicated on the
T/G ranks that share it (as kv heads are). Under sequence parallelism that is one AG->GEMM
(`fused_all_gather_matmul`: the sequence shard in, this rank's in_proj rows of the whole
sequence out), the conv, scan and norm on local channels, and one GEMM->RS
(`fused_matmul_reduce_scatter`, out_proj as `FusedRowwiseParallel`).

This rank's in_proj rows (z_r, x_r, B_r, C_r, dt_r) and conv channels (x_r, B_r, C_r) are not
one contiguous block of the model's weight, so those parameters are DTensors ``Shard(0)`` of
the *assembled* weight: every rank's rows in rank order, ``W[layout.in_rows()]`` (likewise
``conv1d.weight[layout.conv_rows()]``), B/C rows repeated where they are replicated. Their
``full_tensor()`` is that assembled weight, not the model's layout (so is a DCP checkpoint's
copy: `MixerLayout.to_model`, or `commfuse.tp.attention.unpack_rows` with the module's
``_commfuse_rows``, maps it back); a replicated row's gradient is summed over the ranks that share it, so its copies stay equal.
The other parameters are plain ``Shard(0)`` / ``Shard(1)`` DTensors in the model's layout.

The gated norm is exact under the split: a rank holds whole norm groups (G >= T), or the
group's sum of squares is summed over the T/G ranks that share it (G < T). The conv and scan
are the model module's own cache-aware functions (``causal_conv1d_forward``,
``mamba2_scan_forward``; its torch code on CPU) run on this rank's channels, the scan on a
local view of the mixer (its heads, groups, A_log, D, dt_bias); the fused split-conv1d-scan
kernel is not used. With a generation cache (transformers' lazily allocated linear-attention
layers, shaped by what is first written) the cache therefore holds this rank's conv channels
x_r | B_r | C_r and the SSM states of its heads: a prefill on the sequence-sharded path writes
them from the whole sequence, and a decode step (fewer tokens than ranks, no gradients:
``SeqSplit.replicated``, every token on every rank) is the model's single-step conv and state
update on them, in_proj a local GEMM and out_proj a local GEMM closed by an all-reduce.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from commfuse.ops.fused import fused_all_gather_matmul
from commfuse.tp.attention import AssembledRows, unpack_rows
from commfuse.tp.mixers import assemble
from commfuse.tp.functional import all_sum, sum_grad
from commfuse.tp.sequence import _mesh_group, _param
from commfuse.tp.style import _Fused

MIXER = ("in_proj", "conv1d", "out_proj", "norm", "A_log", "D", "dt_bias")


def is_mamba2(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba-2 mixer by its parts (`MIXER`: in_proj and out_proj
    linears, a conv1d, A_log, D, dt_bias and a norm)."""
    return (all(hasattr(module, n) for n in MIXER) and isinstance(module.in_proj, nn.Linear)
            and isinstance(module.conv1d, nn.Conv1d) and isinstance(module.out_proj, nn.Linear))


@dataclass(frozen=True)
class MixerLayout:
    """Which rows of a mixer's in_proj / conv1d each of ``world`` ranks owns. ``heads`` H of
    ``head_dim`` P, ``groups`` G of ``state`` N; d_inner = H P."""

    heads: int
    head_dim: int
    groups: int
    state: int
    world: int

    @property
    def replicas(self) -> int:
        """Ranks that hold each B/C group (1 when G >= T)."""
        return max(self.world // self.groups, 1)

    @property
    def local_heads(self) -> int:
        return self.heads // self.world

    @property
    def local_groups(self) -> int:
        return max(self.groups // self.world, 1)

    def group_ids(self, r: int) -> range:
        g = self.local_groups
        return range(r // self.replicas * g, r // self.replicas * g + g)

    def _bc(self, r: int, base: int) -> list[int]:
        n, G = self.state, self.groups
        return [base + part * G * n + g * n + i for part in (0, 1) for g in self.group_ids(r)
                for i in range(n)]

    def in_rows(self, r: int | None = None) -> torch.Tensor:
        """Rank r's in_proj rows in the model's layout, in order z_r, x_r, B_r, C_r, dt_r
        (every rank's, concatenated, when r is None)."""
        if r is None:
            return torch.cat([self.in_rows(q) for q in range(self.world)])
        d, c, h = self.heads * self.head_dim, self.local_heads * self.head_dim, self.local_heads
        ch = list(range(r * c, r * c + c))
        dt = [2 * d + 2 * self.groups * self.state + r * h + i for i in range(h)]
        return torch.tensor(ch + [d + i for i in ch] + self._bc(r, 2 * d) + dt)

    def conv_rows(self, r: int | None = None) -> torch.Tensor:
        """Rank r's conv1d channels in the model's layout: x_r, B_r, C_r."""
        if r is None:
            return torch.cat([self.conv_rows(q) for q in range(self.world)])
        d, c = self.heads * self.head_dim, self.local_heads * self.head_dim
        return torch.tensor(list(range(r * c, r * c + c)) + self._bc(r, d))

    def to_model(self, assembled: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The model's layout of an assembled weight (``rows``: `in_rows()` or `conv_rows()`);
        a replicated row's copies are equal, any one is kept."""
        return unpack_rows(AssembledRows(rows), assembled, self.world)


def mixer_layout(mixer: nn.Module, T: int, where: str = "mixer") -> MixerLayout:
    """The mixer's `MixerLayout` on ``T`` ranks; ValueError naming what is missing or what
    does not divide."""
    missing = [n for n in MIXER if not hasattr(mixer, n)]
    missing += [n for n in ("num_heads", "head_dim", "n_groups", "ssm_state_size",
                            "intermediate_size", "chunk_size")
                if not isinstance(getattr(mixer, n, None), int)]
    if missing:
        raise ValueError(f"{where} ({type(mixer).__name__}) is not a Mamba-2 mixer: missing "
                         f"{', '.join(missing)}")
    H, G = mixer.num_heads, mixer.n_groups
    if H % T:
        raise ValueError(f"{where}: num_heads ({H}) must be divisible by the TP size ({T}) "
                         f"(each rank owns whole SSM heads)")
    if G % T and T % G:
        raise ValueError(f"{where}: n_groups ({G}) and the TP size ({T}) must divide one "
                         f"another (B/C groups are split, or replicated when fewer than ranks)")
    if H % G:
        raise ValueError(f"{where}: num_heads ({H}) must be divisible by n_groups ({G})")
    d = H * mixer.head_dim
    if mixer.intermediate_size != d:
        raise ValueError(f"{where}: intermediate_size ({mixer.intermediate_size}) must be "
                         f"num_heads * head_dim ({H} * {mixer.head_dim})")
    norm = mixer.norm
    if isinstance(getattr(norm, "group_size", None), int):
        if norm.group_size * G != d:
            raise ValueError(f"{where}: the gated norm's group_size ({norm.group_size}) must "
                             f"be intermediate_size / n_groups ({d} / {G})")
    elif isinstance(getattr(norm, "n_groups", None), int):
        if norm.n_groups != G:
            raise ValueError(f"{where}: the gated norm's n_groups ({norm.n_groups}) must be "
                             f"the mixer's ({G})")
    elif not isinstance(norm, nn.Identity):
        raise ValueError(f"{where}: its norm ({type(norm).__name__}) is not a gated RMSNorm "
                         f"with group_size or n_groups, nor nn.Identity (no norm)")
    return MixerLayout(H, mixer.head_dim, G, mixer.ssm_state_size, T)


class MambaMixerParallel(_Fused):
    """On a Mamba-2 mixer: in_proj / conv1d as assembled ``Shard(0)`` DTensors, A_log, D,
    dt_bias and norm.weight ``Shard(0)``, a ``mup_vector`` buffer cut to this rank's in_proj
    rows; its forward becomes the sequence-parallel one (the
    module docstring). out_proj needs `FusedRowwiseParallel` in the same plan.
    ``save_gathered``: as for `FusedColwiseParallel`."""

    def __init__(self, *, save_gathered: bool = False, **kw):
        super().__init__(**kw)
        self.op_kwargs["save_gathered"] = save_gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = _mesh_group(device_mesh)
        lay = mixer_layout(module, device_mesh.size())
        rows = {"in_proj": lay.in_rows(), "conv1d": lay.conv_rows()}
        assemble(module, rows, device_mesh)
        mup = getattr(module, "mup_vector", None)  # Falcon-H1: a multiplier per in_proj row
        if isinstance(mup, torch.Tensor):
            module.register_buffer("mup_vector", mup[..., lay.in_rows(group.rank())],
                                   persistent=False)
        for m, name in ((module, "A_log"), (module, "D"), (module, "dt_bias"),
                        (module.norm, "weight")):
            p = getattr(m, name, None)
            if p is None:  # no norm (nn.Identity)
                continue
            m.register_parameter(name, _param(p, device_mesh, Shard(0), p.requires_grad))
        module._commfuse_layout = lay
        return self._install(module, device_mesh, self._forward)

    def _bc_summed(self, t: torch.Tensor, start: int, lay: MixerLayout, group) -> torch.Tensor:
        """``t`` with its B/C rows [start, start + 2 G_r N) entering through `sum_grad` over
        the ranks that share them (replicated groups)."""
        if lay.replicas == 1:
            return t
        n = 2 * lay.local_groups * lay.state
        slot, slots = group.rank() // lay.replicas, group.size() // lay.replicas
        bc = sum_grad(t[start:start + n], group, slot, slots)
        return torch.cat([t[:start], bc, t[start + n:]])

    def _forward(self, mixer: nn.Module, group, hidden_states: torch.Tensor, cache=None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        lay: MixerLayout = mixer._commfuse_layout
        code = sys.modules[type(mixer).__module__]  # the model's own conv and scan functions
        dtype = hidden_states.dtype
        c, h, gn = lay.local_heads * lay.head_dim, lay.local_heads, lay.local_groups * lay.state
        replicated = self.split is not None and self.split.replicated
        if attention_mask is not None:  # padding: zero this rank's rows of the input
            rows = attention_mask
            if not replicated:
                sizes = self.sizes or (hidden_states.shape[self.dim],) * group.size()
                off = sum(sizes[:group.rank()])
                rows = attention_mask[:, off:off + sizes[group.rank()]]
            hidden_states = hidden_states * rows[:, :, None]
        if hasattr(mixer, "ssm_in_multiplier"):  # Falcon-H1: a scalar on the input
            hidden_states = hidden_states * mixer.ssm_in_multiplier
        # 1. in_proj: AG -> GEMM, this rank's rows z_r | x_r | B_r | C_r | dt_r of the sequence
        w = self._bc_summed(mixer.in_proj.weight.to_local(), 2 * c, lay, group)
        if replicated:  # every token here (a decode step): a local GEMM
            zxbcdt = hidden_states @ w.t()
        else:
            _, (zxbcdt,) = fused_all_gather_matmul(hidden_states, [w.t()], self.dim, group,
                                                   return_A=False, sizes=self.sizes,
                                                   prefetch=self.prefetch, **self.op_kwargs)
        if mixer.in_proj.bias is not None:
            zxbcdt = zxbcdt + self._bc_summed(mixer.in_proj.bias.to_local(), 2 * c, lay, group)
        if getattr(mixer, "mup_vector", None) is not None:  # this rank's rows of it
            zxbcdt = zxbcdt * mixer.mup_vector
        z, xbc, dt = zxbcdt.split([c, c + 2 * gn, h], dim=-1)
        # 2. causal depthwise conv over this rank's x | B | C channels (the cache's conv state:
        # these channels' last inputs)
        cb = mixer.conv1d.bias
        conv = SimpleNamespace(
            weight=self._bc_summed(mixer.conv1d.weight.to_local(), c, lay, group),
            bias=None if cb is None else self._bc_summed(cb.to_local(), c, lay, group),
            kernel_size=mixer.conv1d.kernel_size)
        xbc = code.causal_conv1d_forward(conv, xbc.transpose(1, 2), cache, mixer.layer_idx,
                                         activation=mixer.activation).transpose(1, 2)
        if attention_mask is not None:
            xbc = (xbc * attention_mask[:, :, None]).to(xbc.dtype)
        x, B, C = xbc.split([c, gn, gn], dim=-1)
        # 3. the scan, local per head, over the whole sequence (or one step from the cache's
        # SSM state of this rank's heads), by the model's own function on a local view
        local = SimpleNamespace(
            A_log=mixer.A_log.to_local(), D=mixer.D.to_local(), dt_bias=mixer.dt_bias.to_local(),
            num_heads=h, head_dim=lay.head_dim, n_groups=lay.local_groups,
            ssm_state_size=lay.state, intermediate_size=c, chunk_size=mixer.chunk_size,
            time_step_limit=mixer.time_step_limit, layer_idx=mixer.layer_idx)
        y = code.mamba2_scan_forward(local, x, B, C, dt, cache)
        # 4. gated RMS norm per group, 5. out_proj: GEMM -> RS (FusedRowwiseParallel), or a
        # local GEMM and an all-reduce on a replicated split
        y = self._gated_norm(mixer.norm, y, z, lay, group)
        return mixer.out_proj(y.to(dtype))

    @staticmethod
    def _gated_norm(norm: nn.Module, y, z, lay: MixerLayout, group) -> torch.Tensor:
        """``norm(y, z)`` on this rank's channels: whole groups here (G >= T), or one part of
        a group whose sum of squares is summed over the ranks that share it (G < T). A norm
        with ``norm_before_gate`` (Falcon-H1's) multiplies its weight in float32 and gates
        after normalising when that is set; ``nn.Identity`` is y * silu(z)."""
        if isinstance(norm, nn.Identity):
            return y * nn.functional.silu(z)
        dtype, falcon = y.dtype, hasattr(norm, "norm_before_gate")
        gate_after = falcon and norm.norm_before_gate
        y = y.float() if gate_after else y.float() * nn.functional.silu(z.float())
        parts = lay.local_groups if lay.replicas == 1 else 1
        yg = y.unflatten(-1, (parts, -1))
        ss = yg.pow(2).sum(-1, keepdim=True)
        if lay.replicas > 1:
            ss = all_sum(ss, group, group.rank() // lay.replicas,
                                group.size() // lay.replicas)
        var = ss / (lay.heads * lay.head_dim // lay.groups)
        y = (yg * torch.rsqrt(var + norm.variance_epsilon)).flatten(-2)
        if not falcon:
            return norm.weight.to_local() * y.to(dtype)
        y = norm.weight.to_local() * y
        return (y * nn.functional.silu(z.float()) if gate_after else y).to(dtype)

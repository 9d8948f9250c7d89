"""Multi-head latent attention (MLA: DeepSeek-V2/V3 and the transformers families that share
its code) under TPSP.

MLA compresses each token into small latents: ``q_a_proj`` -> ``q_a_layernorm`` (width
``q_lora_rank``; without it, ``q_proj`` reads the hidden state) and ``kv_a_proj_with_mqa``
-> ``[kv latent | k_pe]`` (``kv_lora_rank``, normed by ``kv_a_layernorm``, and the rotary
key of ``qk_rope_head_dim`` that every head shares); ``q_b_proj`` and ``kv_b_proj`` expand
them into each head's q and ``[k_nope | v]``; ``o_proj`` closes. On T ranks (H heads, H
divisible by T), sequence-sharded hidden states in and out:

    q_a_proj, kv_a_proj_with_mqa   replicated, on this rank's tokens (SequenceParallelNorm:
    q_a_layernorm, kv_a_layernorm  gradients summed over TP)
    q_b_proj (or q_proj)           AG->GEMM of the normed q latent (or the hidden state)
                                   with this rank's H/T heads' rows
    kv_b_proj                      AG->GEMM of ``[kv latent | k_pe]`` with ``[W_r^T ; 0]``
                                   (zero rows for k_pe); the gathered buffer, returned by
                                   the same op, gives every rank every token's k_pe
    o_proj                         GEMM->RS (FusedRowwiseParallel)

Two gathers, not one of ``[q latent | kv latent | k_pe]``: a fused AG->GEMM's weights span
every column of its input, so one gather would feed q_b_proj through zero rows for the kv
latent and k_pe (at DeepSeek-V3's widths 1536 | 512 | 64: 37% more q_b_proj FLOPs), while
the second gather is one more small transfer that kv_b_proj's GEMM hides; the zero rows
kept (k_pe's, 64 of 576) cost 12% of kv_b_proj's FLOPs.

`MLAParallel` runs this before the attention's own code (a forward pre-hook) and hands it
the results as it asks for them: its ``hidden_states`` become the gathered
``[kv latent | k_pe]`` (the code reads only their shape, (B, S), and passes them to the
projections), and each submodule, called on what the relay expects, returns:

    q_a_proj(A_kv) -> A_q (the gathered, normed q latent)   q_proj(A_kv)  -> Y_q
    q_a_layernorm(A_q) -> A_q                               q_b_proj(A_q) -> Y_q
    kv_a_proj_with_mqa(A_kv) -> A_kv                        kv_a_layernorm(its kv columns)
    kv_b_proj(its kv columns) -> Y_kv                         -> themselves (normed already)

kv_b_proj given other latents of the whole sequence (a cache's, in a prefill) runs a local
GEMM on them. A decode step (`commfuse.tp.sequence.SeqSplit` ``replicated``) relays nothing:
every submodule runs its replicated path, and the cache holds the latents of every token.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh

from commfuse.ops.fused import fused_all_gather_matmul
from commfuse.tp.style import PlanStyles
from commfuse.tp.sequence import _mesh_group
from commfuse.tp.style import _even, _Fused

LATENT = ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm")  # replicated
HEADS = ("q_b_proj", "q_proj", "kv_b_proj")  # column-parallel by heads


def is_mla(module: nn.Module) -> bool:
    """Whether ``module`` is a multi-head latent attention (it has ``kv_a_proj_with_mqa``
    and ``kv_b_proj`` linears)."""
    return all(isinstance(getattr(module, n, None), nn.Linear)
               for n in ("kv_a_proj_with_mqa", "kv_b_proj"))


def mla_plan(attn: nn.Module, where: str, cfg, T: int, ps: PlanStyles) -> tuple[dict, list]:
    """The styles of the MLA ``attn`` (at ``where``) and its submodules on ``T`` ranks, the
    attention's `MLAParallel` last, and what it cannot cover (empty when it can)."""
    H, problems = cfg.num_attention_heads, []
    if H % T:
        problems.append(f"{where}: multi-head latent attention with {H} heads cannot be split "
                        f"over {T} ranks (q_b_proj, kv_b_proj and o_proj hold whole heads)")
    rkv, rope = getattr(attn, "kv_lora_rank", None), getattr(attn, "qk_rope_head_dim", None)
    if not (isinstance(rkv, int) and isinstance(rope, int)
            and attn.kv_a_proj_with_mqa.out_features == rkv + rope):
        problems.append(f"{where}: kv_a_proj_with_mqa's width is not the attention's "
                        f"kv_lora_rank + qk_rope_head_dim")
    q_lora = getattr(attn, "q_a_proj", None) is not None  # else q_proj reads the hidden state
    q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if q_lora else ("q_proj",)
    roles = {n: ps.norm for n in LATENT} | {n: ps.col for n in HEADS} | {"o_proj": ps.row}
    parts = (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    styles = {}
    for name in parts:
        mod = getattr(attn, name, None)
        linear = name.endswith("_proj") or name == "kv_a_proj_with_mqa"
        if mod is None or linear != isinstance(mod, nn.Linear):
            problems.append(f"{where}.{name}: missing or not "
                            f"{'an nn.Linear' if linear else 'a norm'}")
        styles[f"{where}.{name}"] = roles[name]
    extra = [n or "(its own)" for n, mod in attn.named_modules()
             if next(mod.parameters(recurse=False), None) is not None and n not in parts]
    if extra:
        problems.append(f"{where} ({type(attn).__name__}): a multi-head latent attention with "
                        f"parameters in {extra}, which its plan does not cover (it covers "
                        f"DeepSeek-V3's: {', '.join(LATENT + HEADS)}, o_proj)")
    styles[where] = MLAParallel(rkv or 0, q_lora=q_lora, prefetch=ps.chain, **ps.ag)
    return styles, problems


def _views(x: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``x`` is ``t`` or a view of its leading columns over all its tokens."""
    return x is t or (x.data_ptr() == t.data_ptr()
                      and math.prod(x.shape[:-1]) == math.prod(t.shape[:-1]))


class _Relay:
    """One attention call's results, each handed once to the submodule that asks for it on
    the tensor it expects (``out`` None: that tensor itself)."""

    def __init__(self):
        self.outs: dict[int, tuple[str, torch.Tensor, torch.Tensor | None]] = {}

    def put(self, name: str, module: nn.Module, expect: torch.Tensor, out=None) -> None:
        self.outs[id(module)] = (name, expect, out)

    def armed(self, module: nn.Module) -> bool:
        return id(module) in self.outs

    def take(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        entry = self.outs.get(id(module))
        if entry is None or not _views(x, entry[1]):
            return None
        del self.outs[id(module)]
        out = entry[2]
        return x if out is None else out.reshape(*x.shape[:-1], out.shape[-1])

    def drop(self, module: nn.Module) -> None:
        self.outs.pop(id(module), None)

    def finish(self, attn: nn.Module) -> None:
        left, self.outs = [name for name, _, _ in self.outs.values()], {}
        if left:
            raise RuntimeError(f"MLAParallel: {type(attn).__name__} did not call {left} on the "
                               f"gathered latents (its forward differs from DeepSeek-V3's)")


class MLAParallel(_Fused):
    """On a multi-head latent attention whose submodules carry the styles `mla_plan` gives
    them: before the attention runs, its latents on this rank's tokens (replicated
    q_a_proj / kv_a_proj_with_mqa and their norms), two fused AG->GEMMs (q latent or hidden
    state -> q_b_proj / q_proj; ``[kv latent | k_pe]`` -> kv_b_proj, the gathered buffer
    returned), the results relayed to the attention's own code (module docstring).
    ``kv_lora_rank``: the kv latent's width; ``q_lora``: q goes through q_a_proj.
    Backward: each AG->GEMM's fused reduce-scatter (k_pe's gradient through the returned
    buffer); the latents' weights get their gradients summed over TP.
    ``save_gathered``: as for `commfuse.tp.style.FusedColwiseParallel`."""

    def __init__(self, kv_lora_rank: int, *, q_lora: bool, input_kwarg: str = "hidden_states",
                 save_gathered: bool = False, **kw):
        super().__init__(**kw)
        self.op_kwargs["save_gathered"] = save_gathered
        self.rkv, self.q_lora, self.input_kwarg = kv_lora_rank, q_lora, input_kwarg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, relay = _mesh_group(device_mesh), _Relay()
        names = (("q_a_proj", "q_a_layernorm", "q_b_proj") if self.q_lora else ("q_proj",)) + (
            "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
        mods = {n: module.get_submodule(n) for n in names}
        inner = {n: m.forward for n, m in mods.items()}  # their styles' forwards
        q_up, kv_b = mods[names[-4]], mods["kv_b_proj"]
        for n in names:
            if n in HEADS and getattr(mods[n], "_commfuse_colwise", None) is None:
                raise TypeError(f"MLAParallel: {n} has no FusedColwiseParallel style")
            mods[n].forward = self._relayed(mods[n], inner[n], relay, group,
                                            local=n == "kv_b_proj")
        uniform = _even(q_up, 0, group) and _even(kv_b, 0, group)

        def gather(x, up, pad=0, **kw):
            w, b = up._commfuse_colwise.local(up, group)
            if pad:  # zero rows: the columns of the gathered input no weight reads
                w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
            a, (y,) = fused_all_gather_matmul(x, [w], self.dim, group, return_A=True,
                                              sizes=self.sizes, uniform_b=uniform,
                                              **self.op_kwargs, **kw)
            return a, y if b is None else y + b

        def pre(mod, args, kwargs):
            if self.split is not None and self.split.replicated:
                return None  # a decode step: each submodule's replicated path
            x = args[0] if args else kwargs.get(self.input_kwarg)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"MLAParallel: {type(mod).__name__} got no positional input "
                                 f"and no {self.input_kwarg!r} keyword")
            # this rank's tokens: the kv latent normed, k_pe as it is
            ckv = inner["kv_a_proj_with_mqa"](x)
            kv = inner["kv_a_layernorm"](ckv[..., :self.rkv])
            a_kv, y_kv = gather(torch.cat([kv, ckv[..., self.rkv:]], -1), kv_b,
                                pad=ckv.shape[-1] - self.rkv)
            # q last: the largest gather, whose re-gather o_proj's backward posts ahead
            q = inner["q_a_layernorm"](inner["q_a_proj"](x)) if self.q_lora else x
            a_q, y_q = gather(q, q_up, prefetch=self.prefetch)
            if self.q_lora:
                relay.put("q_a_proj", mods["q_a_proj"], a_kv, a_q)
                relay.put("q_a_layernorm", mods["q_a_layernorm"], a_q)
                relay.put("q_b_proj", q_up, a_q, y_q)
            else:
                relay.put("q_proj", q_up, a_kv, y_q)
            relay.put("kv_a_proj_with_mqa", mods["kv_a_proj_with_mqa"], a_kv, a_kv)
            relay.put("kv_a_layernorm", mods["kv_a_layernorm"], a_kv)
            relay.put("kv_b_proj", kv_b, a_kv, y_kv)
            if args:
                return (a_kv, *args[1:]), kwargs
            return args, {**kwargs, self.input_kwarg: a_kv}

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(lambda mod, *_: relay.finish(mod))
        return module

    def _relayed(self, module: nn.Module, inner, relay: _Relay, group, local: bool):
        """``module``'s forward: its relayed result, else its own style's forward; kv_b_proj
        given other latents of the whole sequence while relaying (a cache's) runs a local
        GEMM on them (``local``)."""

        def forward(x, *args, **kwargs):
            y = relay.take(module, x)
            if y is not None:
                return y
            if local and relay.armed(module):
                relay.drop(module)
                w, b = module._commfuse_colwise.local(module, group)
                return x @ w if b is None else x @ w + b
            return inner(x, *args, **kwargs)

        return forward

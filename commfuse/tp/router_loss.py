"""Router losses of sparse MoE blocks, as terms to add to the training loss:

- the sequence-level auxiliary balance loss (DeepSeek-V3, Liu et al. 2024, eq. 17-20): per
  sequence b of T tokens, ``f_i = E / (k T) * #(b's tokens routed to expert i)`` and
  ``P_i = mean over b's tokens of s_i``, s the normalized routing scores (the softmax of the
  router logits, or for a sigmoid router, one with DeepSeek-V3's score-correction bias, the
  sigmoids divided by their sum); ``L_seq = coef * mean_b sum_i f_i P_i``;
- the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``coef * mean over tokens of
  logsumexp(router logits)^2``.

Each is summed over the model's sparse blocks (as Megatron-LM adds its per-layer terms).
`RouterLosses` hooks each block's router (``gate`` / ``router``: `commfuse.tp.experts`; a
router that returns a tuple gives its logits at transformers' recorded index) and its
experts (the top-k routed: the router's choices, before any capacity drops them,
`commfuse.moe.capacity`). On a model parallelized by `commfuse.tp.parallelize`, each rank
sees its sequence shard: the per-sequence score sums, the squared log-sum-exps and the
counts are summed over the TP group (`commfuse.tp.functional.sum_ranks`: its backward
passes each rank's gradient through, so the gradient is the unsharded loss's), so every TP
rank gets the unsharded model's terms for the same batch. Under data parallelism each dp
rank's terms are its own batch's, as its cross-entropy is.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from commfuse.tp.balance import BIAS
from commfuse.tp.experts import expert_spec, router_logits_index
from commfuse.tp.functional import sum_ranks

SCORES = ("auto", "softmax", "sigmoid")


def _coef(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"RouterLosses: {name} must be a finite number >= 0 (0: off), "
                         f"got {value!r}")
    return float(value)


class RouterLosses:
    """The sequence-level auxiliary loss (coefficient ``seq_aux``) and the router z-loss
    (``z``) of every routed sparse block of ``model`` (module docstring); 0 turns a term off.
    Each training forward (one with gradients) records its blocks; `take` returns the
    terms' sum over the forwards since the last call (a 0-dim tensor that carries their
    gradient: add it to the loss before ``backward``) and keeps each term in `last`.
    ``score``: the normalized scores of the sequence-level loss; auto is sigmoid for routers
    with a ``e_score_correction_bias`` (DeepSeek-V3, GLM-4.5), else softmax."""

    def __init__(self, model: nn.Module, *, seq_aux: float = 0.0, z: float = 0.0,
                 score: str = "auto", logits_index: int | None = None):
        self.seq_aux, self.z = _coef("seq_aux", seq_aux), _coef("z", z)
        if score not in SCORES:
            raise ValueError(f"RouterLosses: score must be one of {list(SCORES)}, got {score!r}")
        self.index = router_logits_index(model) if logits_index is None else logits_index
        self.blocks = [(m, s) for m in model.modules()
                       if (s := expert_spec(m)) is not None and s.routed]
        self.last: dict[str, torch.Tensor] = {}
        self._done: list[dict] = []  # one entry per block per recorded forward
        if not (self.seq_aux or self.z):
            return
        for block, spec in self.blocks:
            router = getattr(block, spec.router)
            sigmoid = score == "sigmoid" or (score == "auto" and hasattr(router, BIAS))
            state: dict = {"sigmoid": sigmoid, "block": block}
            block.register_forward_pre_hook(self._shape_hook(state), with_kwargs=True)
            router.register_forward_hook(self._router_hook(state), with_kwargs=True)
            block.experts.register_forward_pre_hook(self._experts_hook(state), with_kwargs=True)

    @staticmethod
    def _shape_hook(state: dict):
        def remember(_, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            state["B"] = x.shape[0] if x is not None and x.dim() == 3 else 1
        return remember

    def _router_hook(self, state: dict):
        def capture(_, args, kwargs, out):
            if not torch.is_grad_enabled():
                return
            x = args[0] if args else kwargs.get("hidden_states")
            logits = out[self.index] if isinstance(out, tuple) else out
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            B, E = state.get("B", 1), logits.shape[-1]
            # more rows than the router was given: the sequence's logits, gathered while
            # transformers records them (`ExpertParallel`): already the whole sequence
            whole = logits.shape[0] != x.reshape(-1, x.shape[-1]).shape[0]
            if state["sigmoid"]:
                s = logits.sigmoid()
                s = s / (s.sum(-1, keepdim=True) + 1e-20)
            else:
                s = logits.softmax(-1)
            state["pending"] = {"whole": whole, "B": B, "rows": logits.shape[0],
                                "p": s.reshape(B, -1, E).sum(1),  # [B, E] score sums
                                "z": torch.logsumexp(logits, -1).square().sum()}
        return capture

    def _experts_hook(self, state: dict):
        def count(_, args, kwargs):
            entry = state.pop("pending", None)
            if entry is None or not torch.is_grad_enabled():
                return
            index = args[1] if len(args) > 1 else next(
                v for k, v in kwargs.items() if "index" in k or "indices" in k)
            B, E = entry["B"], entry["p"].shape[-1]
            i_Bn = index.reshape(B, -1).long()
            c = torch.zeros(B, E, dtype=entry["p"].dtype, device=i_Bn.device)
            entry["c"] = c.scatter_add_(1, i_Bn, torch.ones_like(i_Bn, dtype=c.dtype))
            entry["k"], entry["tokens"] = index.shape[-1], index.shape[0] // B
            entry["group"] = getattr(state["block"], "_commfuse_seq_group", None)
            self._done.append(entry)
        return count

    def take(self) -> torch.Tensor:
        """The terms' sum over the forwards recorded since the last call (each its blocks'
        sum), and starts over; zero when none was recorded. Every rank of a TP group calls
        it after the same forwards (it all-reduces over the group)."""
        done, self._done = self._done, []
        if not done:
            zero = torch.zeros(())
            self.last = {"seq_aux": zero, "z": zero}
            return zero
        group = done[0]["group"]
        tp = group is not None and dist.is_initialized() and group.size() > 1
        # counts and tokens per sequence over the group: no gradient, one all-reduce
        counted = torch.cat([torch.cat([e["c"].reshape(-1), e["c"].new_tensor([e["tokens"]])])
                             for e in done])
        if tp:
            dist.all_reduce(counted, group=group)
        # each entry's score sums and squared log-sum-exp; the shards' summed over the group
        # in one all-reduce, gradient through
        p_zs = [torch.cat([e["p"].reshape(-1), e["z"].reshape(1)]) for e in done]
        parts = [p_z for p_z, e in zip(p_zs, done) if not e["whole"]]
        if parts:
            flat = sum_ranks(torch.cat(parts), group) if tp else torch.cat(parts)
            summed = iter(flat.split([p.numel() for p in parts]))
        at, seq, z = 0, [], []
        for e, p_z in zip(done, p_zs):
            B, E = e["p"].shape
            c_BE = counted[at:at + B * E].view(B, E)
            T = counted[at + B * E]  # tokens per sequence, the whole sequence
            at += B * E + 1
            if not e["whole"]:
                p_z = next(summed)
            P_BE = p_z[:-1].view(B, E) / T
            f_BE = c_BE * (E / (e["k"] * T))
            seq.append((f_BE * P_BE).sum(1).mean())
            z.append(p_z[-1] / (B * T))
        seq_aux, z = self.seq_aux * torch.stack(seq).sum(), self.z * torch.stack(z).sum()
        self.last = {"seq_aux": seq_aux.detach(), "z": z.detach()}
        return seq_aux + z

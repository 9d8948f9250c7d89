"""Parallelism applied to the plain `commfuse.models.llama.Llama` by a plan, not by editing it.

    dims = ParallelDims(tp=2, dp=2, method="commfuse", method_opts={"topology": "ring"})
    mesh = dims.build_mesh()                   # the process groups (collective, every rank)
    pmodel = parallelize(Llama(cfg), mesh)     # the model's blocks swapped for sharded ones
    loss = pmodel.loss(tokens_BS, targets_BS)  # this rank's share of the global mean loss
    loss.backward(); pmodel.sync_grads()       # + all-reduce of the replicated parameters
    opt = torch.optim.AdamW(pmodel.parameters())  # sharded by construction (local shards)

The plan: TP (`tensor.py`) swaps each block's `attn` / `mlp` for `TPAttention` / `TPMLP`;
UP (`ulysses.py`) swaps `attn` for `UPAttention`; with TP or UP the embedding is replaced by
one that keeps this rank's sequence shard (same weight), so everything between the blocks,
the final norm and the output head included, runs on [B, S/seq, D]. DP (`data.py`) replaces
every remaining Linear by a `ShardedLinear` (ZeRO-3; the output head too, unless tied) and,
under TP/UP x DP, shards the TP/UP weights by rows over DP as well. The unsharded model is the
reference: `parallelize` copies the shards out of it, so build it from the same seed everywhere.

Checkpoints of a parallelized model: `commfuse.parallel.checkpoint`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commfuse.parallel.config import Mesh, ParallelDims, sharded_axes
from commfuse.parallel.data import ShardedLinear, shard_linears
from commfuse.parallel.layout import SeqLayout, SeqShardEmbedding
from commfuse.parallel.tensor import TPAttention, TPMLP
from commfuse.parallel.ulysses import UPAttention


def parallelize(model: nn.Module, plan: ParallelDims | Mesh | None) -> ParallelLlama:
    """Apply ``plan`` to ``model`` (a Llama, modified in place) and wrap it.

    ``plan``: a `Mesh` (its groups are used), a `ParallelDims` (``build_mesh()`` is called,
    which is collective), or None (single process: the wrapper only).
    """
    if plan is None:
        return ParallelLlama(model, None)
    mesh = plan if isinstance(plan, Mesh) else plan.build_mesh()
    dims, kw, dp = mesh.dims, mesh.dims.op_kwargs, mesh.dp_group
    dims.check_model(model.cfg)
    layout = SeqLayout(mesh.seq_index, dims.seq)
    if dims.seq > 1:
        model.tok_emb = SeqShardEmbedding(model.tok_emb, layout)
    for i, layer in enumerate(model.layers):
        if dims.tp > 1:
            layer.attn = TPAttention(layer.attn, mesh.seq_group, kw, dp, dims.query_split, layout)
            layer.mlp = TPMLP(layer.mlp, mesh.seq_group, kw, dp, layout)
        elif dims.up > 1:
            layer.attn = UPAttention(layer.attn, mesh.seq_group, kw, dp, layout)
        if dp is not None:  # whatever Linear is left (UP's MLP, or all of them without TP/UP)
            shard_linears(layer, dp, kw, f"layers.{i}.")
    if dp is not None and not model.cfg.tie_embeddings:
        model.output = ShardedLinear(model.output.weight, dp, kw, "output")
    return ParallelLlama(model, mesh)


class ParallelLlama(nn.Module):
    """A parallelized Llama: local logits, a correctly scaled loss, gradient sync, full grads."""

    def __init__(self, model: nn.Module, mesh: Mesh | None):
        super().__init__()
        self.model, self.mesh = model, mesh

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's tokens: its batch, its sequence shard [B, S/seq, V]."""
        return self.model(tokens_BS)

    def seq_shard(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This rank's sequence shard of a [B, S, ...] tensor (all of it without TP/UP)."""
        if self.mesh is None or self.mesh.dims.seq == 1:
            return t_BS
        return SeqLayout(self.mesh.seq_index, self.mesh.dims.seq).shard(t_BS)

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global mean cross-entropy (float32; -100 ignored).

        ``tokens_BS`` / ``targets_BS`` are this rank's DP batch, whole sequences. Returns
        sum(local token losses) / (target tokens over all ranks), so the sum over ranks is the
        mean over the global batch and ``backward()`` on every rank yields its gradients
        (DP averaging included). `global_loss` turns it into the reported value.
        """
        logits_BsV = self(tokens_BS)
        targets_Bs = self.seq_shard(targets_BS)
        total = F.cross_entropy(logits_BsV.flatten(0, 1).float(), targets_Bs.flatten(),
                                ignore_index=-100, reduction="sum")
        count = (targets_Bs != -100).sum().to(torch.float32)
        if self.mesh is not None:
            dist.all_reduce(count, group=self.mesh.world_group)
        return total / count.clamp_min(1.0)

    def global_loss(self, local_loss: torch.Tensor) -> float:
        """The global mean loss from every rank's `loss` (collective)."""
        value = local_loss.detach().clone().float()
        if self.mesh is not None:
            dist.all_reduce(value, group=self.mesh.world_group)
        return value.item()

    def _sync_buckets(self) -> dict[str, list[nn.Parameter]]:
        buckets: dict[str, list[nn.Parameter]] = {}
        for p in self.parameters():  # deduplicated: a tied weight is synced once
            axes = sharded_axes(p)
            need = [a for a, g in (("seq", self.mesh.seq_group), ("dp", self.mesh.dp_group))
                    if g is not None and a not in axes]
            if need:
                buckets.setdefault("+".join(need), []).append(p)
        return buckets

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the gradients of replicated parameters over the axes they are replicated on.

        Sharded weights already hold their gradient shard (the fused ops' backward did the
        reduce-scatter); the norms, the embedding, the TP output head and the UP weights are
        replicated, so each rank has its contribution: one coalesced all-reduce per group.
        """
        if self.mesh is None:
            return
        groups = {"seq": self.mesh.seq_group, "dp": self.mesh.dp_group,
                  "seq+dp": self.mesh.world_group}
        for key, params in self._sync_buckets().items():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat, group=groups[key])
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    @torch.no_grad()
    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient of the unsharded model, under its reference name (after sync_grads).

        Collective over the TP/UP and DP groups: call it on every rank.
        """
        out, done = {}, set()
        for name, mod in self.model.named_modules():
            if isinstance(mod, (TPAttention, TPMLP, UPAttention)):
                for k, g in mod.full_grads().items():
                    out[f"{name}.{k}.weight"] = g
                done.update(id(p) for p in mod.parameters())
            elif isinstance(mod, ShardedLinear) and id(mod.weight) not in done:
                out[f"{name}.weight"] = mod.full_grad()
                done.add(id(mod.weight))
        for name, p in self.model.named_parameters():
            if id(p) not in done:
                out[name] = p.grad
        return out

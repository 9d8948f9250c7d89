"""Parallelism applied to the plain `commfuse.models.llama.Llama` by a plan, not by editing it.

    dims = ParallelDims(tp=2, dp=2, method="commfuse", method_opts={"topology": "ring"})
    mesh = dims.build_mesh()                   # the process groups (collective, every rank)
    pmodel = parallelize(Llama(cfg), mesh)     # the model's blocks swapped for sharded ones
    loss = pmodel.loss(tokens_BS, targets_BS)  # this rank's share of the global mean loss
    loss.backward()                            # posts the gradient buckets' all-reduces
    pmodel.sync_grads()                        # waits for them, copies the sums back
    opt = torch.optim.AdamW(pmodel.parameters())  # sharded by construction (local shards)

The plan: TP (`tensor.py`) swaps each block's `attn` / `mlp` for `TPAttention` / `TPMLP`;
UP (`ulysses.py`) swaps `attn` for `UPAttention`; with TP or UP the embedding and the output
head become vocabulary-parallel (`vocab.py`): the embedding returns this rank's sequence shard,
so everything between the blocks and the final norm runs on [B, S/seq, D]; the head gathers it
fused with its GEMM and returns this rank's vocabulary slice of the whole sequence's logits,
[B, S, V/seq], and the loss is a vocabulary-parallel cross-entropy. DP (`data.py`) replaces
every remaining Linear by a `ShardedLinear` (ZeRO-3; the output head too, unless tied or
vocabulary-parallel) and, under TP/UP x DP, shards the TP/UP weights (and the untied head's
vocabulary shard, when its rows divide by DP; else it is replicated over DP) by rows over DP.
What stays replicated over an axis (the norms; the embedding over DP; Ulysses' weights over
UP) has its gradient summed by bucketed all-reduces that the backward posts as each bucket's
gradients land (`grad_sync.py`); `sync_grads` waits for them. The unsharded model is the
reference: `parallelize` copies the shards out of it, so build it from the same seed everywhere.

Checkpoints of a parallelized model: `commfuse.parallel.checkpoint`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commfuse.ops.prefetch import Prefetcher as RegatherPrefetcher
from commfuse.parallel.config import Mesh, ParallelDims, sharded_axes
from commfuse.parallel.data import ShardedLinear, gather_rows, shard_linears, weight
from commfuse.parallel.grad_sync import DEFAULT_BUCKET_MB, GradSync
from commfuse.parallel.layout import SeqLayout
from commfuse.parallel.prefetch import Prefetcher as WeightPrefetcher
from commfuse.parallel.tensor import TPAttention, TPMLP
from commfuse.parallel.ulysses import UPAttention
from commfuse.parallel.vocab import (VocabParallelEmbedding, VocabParallelHead,
                                     vocab_parallel_cross_entropy)


def parallelize(model: nn.Module, plan: ParallelDims | Mesh | None,
                bucket_mb: float = DEFAULT_BUCKET_MB) -> ParallelLlama:
    """Apply ``plan`` to ``model`` (a Llama, modified in place) and wrap it.

    ``plan``: a `Mesh` (its groups are used), a `ParallelDims` (``build_mesh()`` is called,
    which is collective), or None (single process: the wrapper only). ``bucket_mb``: size of
    the gradient-sync buckets (`commfuse.parallel.grad_sync`).
    """
    if plan is None:
        return ParallelLlama(model, None)
    mesh = plan if isinstance(plan, Mesh) else plan.build_mesh()
    dims, kw, dp = mesh.dims, mesh.dims.op_kwargs, mesh.dp_group
    dims.check_model(model.cfg)
    layout = SeqLayout(mesh.seq_index, dims.seq)
    # one chain for the whole model: each GEMM->RS's backward posts the AG->GEMM's before it
    prefetch = RegatherPrefetcher(dims.regather_prefetch) if dims.tp > 1 and dims.regather_prefetch \
        else None
    for i, layer in enumerate(model.layers):
        if dims.tp > 1:
            layer.attn = TPAttention(layer.attn, mesh.seq_group, kw, dp, dims.query_split, layout,
                                     prefetch)
            layer.mlp = TPMLP(layer.mlp, mesh.seq_group, kw, dp, layout, prefetch)
        elif dims.up > 1:
            layer.attn = UPAttention(layer.attn, mesh.seq_group, kw, dp, layout)
        if dp is not None:  # whatever Linear is left (UP's MLP, or all of them without TP/UP)
            shard_linears(layer, dp, kw, f"layers.{i}.")
    tied = model.cfg.tie_embeddings
    if dims.seq > 1:  # vocabulary-parallel embedding and head over the TP/UP group
        emb = model.tok_emb = VocabParallelEmbedding(model.tok_emb, mesh.seq_group, layout)
        w_vD = emb.shard(model.output.weight)
        split = dp is not None and w_vD.shape[0] % dp.size() == 0  # else replicated over DP
        head = emb if tied else weight(w_vD, dp if split else None, kw, "output", "seq")
        model.output = VocabParallelHead(head, mesh.seq_group, layout, kw, emb.start)
    elif dp is not None and not tied:
        model.output = ShardedLinear(model.output.weight, dp, kw, "output")
    pmodel = ParallelLlama(model, mesh, bucket_mb, prefetch, layout)
    if dp is not None and dims.prefetch:  # ZeRO-3 prefetch: one unit per block, the head last
        units = [_sharded(layer) for layer in model.layers] + [_sharded(model.output)]
        mb = dims.prefetch_mb
        pmodel.prefetcher = WeightPrefetcher(units, dims.prefetch,
                                       None if mb is None else int(mb * 2 ** 20))
        # a gradient summed again over another axis (UP x DP's MLP) must be complete when
        # its bucket's hook fires: that weight's reduce-scatter ends in its own backward
        synced = {id(p) for b in pmodel.grad_sync.buckets for p in b.params}
        for m in pmodel.prefetcher.modules():
            m.prefetcher = pmodel.prefetcher
            m.defer_reduce = dims.defer_reduce and id(m.weight) not in synced
    return pmodel


def _sharded(module: nn.Module) -> list[ShardedLinear]:
    """The DP-sharded weights under ``module``, in registration order (the forward's)."""
    return [m for m in module.modules() if isinstance(m, ShardedLinear)]


class ParallelLlama(nn.Module):
    """A parallelized Llama: logits, a correctly scaled loss, gradient sync, full grads."""

    def __init__(self, model: nn.Module, mesh: Mesh | None,
                 bucket_mb: float = DEFAULT_BUCKET_MB,
                 prefetch: RegatherPrefetcher | None = None, layout: SeqLayout | None = None):
        super().__init__()
        self.model, self.mesh = model, mesh
        self.layout = layout  # the sequence's split and order, set at each forward (TP/UP)
        self.prefetch = prefetch  # the backward's re-gather prefetch (commfuse.ops.prefetch)
        self.grad_sync = None
        self.prefetcher = None  # ZeRO-3's weight prefetch (commfuse.parallel.prefetch), if on
        if mesh is not None:
            groups = {"seq": mesh.seq_group, "dp": mesh.dp_group, "seq+dp": mesh.world_group}
            self.grad_sync = GradSync(
                [(k, groups[k], ps) for k, ps in self._sync_buckets().items()], bucket_mb)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's batch. With TP/UP: this rank's vocabulary slice of the whole
        sequence, [B, S, V/seq] (`vocab_slice`); otherwise all of them, [B, S, V]. Always in
        the sequence's own order (a balanced forward's are put back)."""
        logits = self._forward(tokens_BS)
        return logits if self.layout is None else self.layout.unpermute(logits)

    def _forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The logits in this forward's order (`SeqLayout`): balanced where TP attention runs
        query-split, so that its ring steps cost the same on every rank."""
        if self.prefetch is not None:  # a gather posted ahead in a backward that did not use it
            self.prefetch.drain()  # is waited out here, where every rank is at the same point
        if self.layout is not None:
            self.layout.begin(tokens_BS.shape[1], self._query_split(tokens_BS.shape),
                              tokens_BS.device)
            tokens_BS = self.layout.permute(tokens_BS)
        return self.model(tokens_BS)

    def _query_split(self, shape_BS) -> bool | None:
        """Whether this forward's TP attention runs query-split (None without TP)."""
        attn = self.model.layers[0].attn if len(self.model.layers) else None
        if not isinstance(attn, TPAttention):
            return None
        return attn.runs_query_split(*shape_BS, self.model.norm.weight)

    def vocab_slice(self) -> slice:
        """The vocabulary columns of `forward`'s logits (all of them without TP/UP)."""
        if self.mesh is None or self.mesh.dims.seq == 1:
            return slice(None)
        emb = self.model.tok_emb
        return slice(emb.start, emb.start + emb.weight.shape[0])

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global mean cross-entropy (float32; -100 ignored).

        ``tokens_BS`` / ``targets_BS`` are this rank's DP batch, whole sequences. Returns
        sum(token losses of this DP batch) / (target tokens over the DP group), so the sum over
        the DP group is the mean over the global batch and ``backward()`` on every rank yields
        its gradients (DP averaging included). With TP/UP the cross-entropy is vocabulary-
        parallel (`commfuse.parallel.vocab`) and the ranks of a TP/UP group hold the same value.
        `global_loss` turns it into the reported value.
        """
        logits = self._forward(tokens_BS)  # in the forward's order: the targets follow it
        if self.mesh is not None and self.mesh.dims.seq > 1:
            targets_BS = self.layout.permute(targets_BS)
            total = vocab_parallel_cross_entropy(logits, targets_BS, self.vocab_slice().start,
                                                 self.mesh.seq_group).sum()
        else:
            total = F.cross_entropy(logits.flatten(0, 1).float(), targets_BS.flatten(),
                                    ignore_index=-100, reduction="sum")
        count = (targets_BS != -100).sum().to(torch.float32)
        if self.mesh is not None and self.mesh.dp_group is not None:
            dist.all_reduce(count, group=self.mesh.dp_group)
        return total / count.clamp_min(1.0)

    def global_loss(self, local_loss: torch.Tensor) -> float:
        """The global mean loss from every rank's `loss` (collective over the DP group)."""
        value = local_loss.detach().clone().float()
        if self.mesh is not None and self.mesh.dp_group is not None:
            dist.all_reduce(value, group=self.mesh.dp_group)
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

    def no_sync(self):
        """Context for the micro-steps of gradient accumulation: their backward posts no
        gradient sync; `sync_grads` after the last backward sums the accumulated gradients."""
        return self.grad_sync.no_sync() if self.grad_sync else contextlib.nullcontext()

    def sync_grads(self) -> None:
        """Finish the gradient sum of replicated parameters over the axes they are replicated on.

        Sharded weights already hold their gradient shard (the fused ops' backward did the
        reduce-scatter; the vocabulary-parallel embedding and head are local). The replicated
        ones (norms; embedding / head over DP; Ulysses weights over UP) are summed by bucketed
        all-reduces that the backward posted as each bucket's gradients became ready
        (`commfuse.parallel.grad_sync`); this posts any bucket left, waits (CommFuseError past
        the group's timeout) and copies the sums into ``.grad``.
        """
        if self.prefetch is not None:  # nothing posted ahead outlives the backward
            self.prefetch.drain()
        if self.grad_sync is not None:
            self.grad_sync.finish()

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
            elif isinstance(mod, VocabParallelHead):
                if mod.w is not self.model.tok_emb:  # tied: the embedding's gradient holds both
                    out[f"{name}.weight"] = gather_rows(mod.w.full_grad(), self.mesh.seq_group)
                done.update(id(p) for p in mod.parameters())
            elif isinstance(mod, VocabParallelEmbedding):
                out[f"{name}.weight"] = gather_rows(mod.weight.grad, self.mesh.seq_group)
                done.add(id(mod.weight))
            elif isinstance(mod, ShardedLinear) and id(mod.weight) not in done:
                out[f"{name}.weight"] = mod.full_grad()
                done.add(id(mod.weight))
        for name, p in self.model.named_parameters():
            if id(p) not in done:
                out[name] = p.grad
        return out

"""Vocabulary-parallel embedding, output head and cross-entropy over the TP/UP group of T ranks
(Megatron style), so the vocabulary-sized weights are sharded and their gradients local.

Rank r holds rows ``[r*v, (r+1)*v)`` of the embedding and of the head, v = V/T (V divisible
by T). Tied embeddings share one shard.

    embedding   e_BSD = lookup(tokens_BS) on my rows, 0 for tokens outside them;
                x_BsD = reduce_scatter(e_BSD, 1)              (plain; backward: all-gather)
    head        logits_BSv = all_gather(x_BsD, 1) @ W_vD^T    one fused AG->GEMM call
                (backward: the fused GEMM->RS of dx, and dW_vD = dlogits^T @ x_BSD, local)
    loss        m = all_reduce_max(max_v logits);  [Z, t] = all_reduce_sum([sum_v e^(logits-m),
                logit of the target if I own it]);  loss_BS = log Z + m - t
                (backward: (softmax - onehot) of my vocabulary slice, local)

The full [B, S, V] logits never exist; every rank of the group computes the loss of the whole
sequence (identical values). Bytes each rank sends per step for the embedding (fp32, ring):
2 (T-1)/T x B*S*D x 4 (reduce-scatter forward + all-gather backward) here, against
2 (T-1)/T x V*D x 4 to all-reduce a replicated embedding's gradient: less while B*S < V (small
preset, 4 x 512 tokens, V = 4096, D = 512, T = 2: 4 MiB against 8 MiB). Neither hides behind
backward compute (the embedding is first in the forward and last in the backward); this one
also shards the embedding's memory and optimizer state.

Shape suffixes: B batch, S sequence, s this rank's sequence shard, D model, V vocab, v = V/T.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commfuse.errors import CommFuseError
from commfuse.ops.fused import fused_all_gather_matmul
from commfuse.runtime import collectives, deadlines, modes

TAG = 7001  # P2P tag of the embedding's reduce-scatter / all-gather


def _collective(kind: str, out: torch.Tensor, inp: torch.Tensor, group, sizes) -> torch.Tensor:
    """``kind`` over dim 0 with ``sizes`` rows per rank, waited with the group's timeout;
    in ``compute_only`` mode the local part only, moving nothing."""
    r = group.rank()
    if modes.current() == "compute_only":
        start = sum(sizes[:r])
        if kind == "reduce_scatter":
            return out.copy_(inp.narrow(0, start, sizes[r]))
        out.narrow(0, start, sizes[r]).copy_(inp)
        return out
    if torch.compiler.is_compiling():  # Dynamo traces functional collectives, not P2P ops:
        from torch.distributed import _functional_collectives as fc  # an all-reduce does both

        start = sum(sizes[:r])
        if kind == "reduce_scatter":
            return fc.all_reduce(inp, "sum", group).narrow(0, start, sizes[r])
        out.narrow(0, start, sizes[r]).copy_(inp)  # out: zeros
        return fc.all_reduce(out, "sum", group)
    work = collectives.launch(kind, out, inp, group, TAG, "auto", sizes=sizes)
    try:  # CPU: within the group's timeout; CUDA: stream-ordered, NCCL's watchdog
        deadlines.wait(work, group, out.device, None)
    except Exception as e:
        raise CommFuseError(f"vocab-parallel embedding: {kind} on rank {r}: {e}") from e
    return out


class _ReduceScatterSeq(torch.autograd.Function):
    """``reduce_scatter(e_BSD, 1)`` summed, ``sizes[rank]`` rows; backward: all-gather."""

    @staticmethod
    def forward(ctx, e_BSD, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        e_SBD = e_BSD.transpose(0, 1).contiguous()
        out_sBD = e_SBD.new_empty((sizes[group.rank()], *e_SBD.shape[1:]))
        return _collective("reduce_scatter", out_sBD, e_SBD, group, sizes).transpose(0, 1)

    @staticmethod
    def backward(ctx, g_BsD):
        g_sBD = g_BsD.transpose(0, 1).contiguous()
        out_SBD = g_sBD.new_zeros((sum(ctx.sizes), *g_sBD.shape[1:]))
        return _collective("all_gather", out_SBD, g_sBD, ctx.group, ctx.sizes).transpose(0, 1), \
            None, None


class VocabParallelEmbedding(nn.Module):
    """The embedding's rows of my vocabulary slice; returns my sequence shard [B, s, D]."""

    def __init__(self, emb: nn.Embedding, group, layout):
        super().__init__()
        from commfuse.parallel.config import mark_sharded

        T, r = group.size(), group.rank()
        v = emb.weight.shape[0] // T
        if emb.weight.shape[0] % T:
            raise ValueError(f"vocab_size ({emb.weight.shape[0]}) must be divisible by the "
                             f"TP/UP group size ({T})")
        self.group, self.layout, self.start = group, layout, r * v
        self.weight = mark_sharded(nn.Parameter(self.shard(emb.weight).detach().clone()), "seq")

    def shard(self, w_VD: torch.Tensor) -> torch.Tensor:
        """My vocabulary rows of a [V, ...] tensor."""
        return w_VD[self.start:self.start + w_VD.shape[0] // self.group.size()]

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        self.layout.shard(tokens_BS)  # records the split of this forward's sequence
        local_BS = tokens_BS - self.start
        outside_BS = (local_BS < 0) | (local_BS >= self.weight.shape[0])
        e_BSD = F.embedding(local_BS.masked_fill(outside_BS, 0), self.weight)
        e_BSD = e_BSD.masked_fill(outside_BS.unsqueeze(-1), 0.0)
        return _ReduceScatterSeq.apply(e_BSD, self.group, self.layout.sizes)


class VocabParallelHead(nn.Module):
    """``logits_BSv = all_gather(x_BsD, 1) @ W_vD^T``: my vocabulary slice of the whole
    sequence's logits (one fused AG->GEMM). ``w``: a weight module (`commfuse.parallel.data.weight`)
    holding my rows, or the tied embedding (``.weight``)."""

    def __init__(self, w: nn.Module, group, layout, op_kwargs: dict, start: int):
        super().__init__()
        self.w, self.group, self.layout = w, group, layout
        self.op_kwargs, self.start = dict(op_kwargs), start

    def forward(self, x_BsD: torch.Tensor) -> torch.Tensor:
        w_vD = self.w.gather() if hasattr(self.w, "gather") else self.w.weight
        # the gather of the next sequence slice hides behind this slice's head GEMM
        _, (logits_BSv,) = fused_all_gather_matmul(x_BsD, [w_vD.t()], 1, self.group,
                                                   sizes=self.layout.sizes, return_A=False,
                                                   **self.op_kwargs)
        return logits_BSv


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy (float32) from vocabulary-sharded logits; 0 where ignored."""

    @staticmethod
    def forward(ctx, logits_BSv, targets_BS, start, group, ignore_index):
        x = logits_BSv.float()
        m_BS = x.amax(-1)
        if modes.current() != "compute_only":
            dist.all_reduce(m_BS, dist.ReduceOp.MAX, group=group)
        e_BSv = torch.exp(x - m_BS.unsqueeze(-1))
        local_BS = targets_BS - start
        mine_BS = (local_BS >= 0) & (local_BS < x.shape[-1])
        idx_BS = local_BS.masked_fill(~mine_BS, 0)
        zt_2BS = torch.stack([e_BSv.sum(-1),
                              x.gather(-1, idx_BS.unsqueeze(-1)).squeeze(-1) * mine_BS])
        if modes.current() != "compute_only":
            dist.all_reduce(zt_2BS, group=group)  # sum-exp and target logit in one call
        keep_BS = targets_BS != ignore_index
        loss_BS = (torch.log(zt_2BS[0]) + m_BS - zt_2BS[1]) * keep_BS
        ctx.save_for_backward(e_BSv.div_(zt_2BS[0].unsqueeze(-1)), idx_BS, mine_BS & keep_BS,
                              keep_BS)
        ctx.dtype = logits_BSv.dtype
        return loss_BS

    @staticmethod
    def backward(ctx, g_BS):
        p_BSv, idx_BS, onehot_BS, keep_BS = ctx.saved_tensors
        g_BSv = p_BSv.clone()
        g_BSv.scatter_add_(-1, idx_BS.unsqueeze(-1), -onehot_BS.unsqueeze(-1).float())
        g_BSv.mul_((g_BS * keep_BS).unsqueeze(-1))
        return g_BSv.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_BSv, targets_BS, start: int, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses [B, S] (float32, 0 where ``targets_BS == ignore_index``) from this
    rank's vocabulary slice ``[start, start + v)`` of the logits (collective over ``group``)."""
    return _VocabParallelCE.apply(logits_BSv, targets_BS, start, group, ignore_index)

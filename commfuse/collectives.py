"""The collectives behind ``none`` and ``sliced``: the backend's own, or the same bytes as P2P.

``collective="backend"`` calls torch.distributed's all-gather / reduce-scatter / all-to-all.
``collective="p2p"`` moves exactly the bytes a ring or pairwise schedule moves, as one batch
of isend/irecv to every peer (the reduce-scatter sums the received chunks in rank order when
waited). ``"auto"`` (the default) takes the backend's on CUDA (NCCL's are the best there) and
P2P elsewhere: on this project's CPU testbed (2 ranks, 4 MB each way, emulated 1 Gbit/s
links) gloo's reduce-scatter took 80-119 ms where the same bytes exchanged point to point took
60-69 ms (and 116 ms against 35-39 ms with the launcher's earlier, smaller tbf burst); its
all-gather took 48-70 ms. A slow baseline would flatter every overlap method.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commfuse import _p2p

KINDS = ("all_gather", "reduce_scatter", "all_to_all")
POLICIES = ("auto", "backend", "p2p")
BACKEND = {  # torch.distributed's own, by kind (the *_single names where this torch has them)
    "all_gather": getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
    "reduce_scatter": getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
    "all_to_all": dist.all_to_all_single,
}


def launch(kind: str, out: torch.Tensor, inp: torch.Tensor, group, tag: int, policy: str):
    """Start ``kind`` (out/inp laid out as torch's ``*_single`` ops) and return its work."""
    if policy == "backend" or (policy == "auto" and out.device.type == "cuda"):
        return BACKEND[kind](out, inp, group=group, async_op=True)
    return _P2PCollective(kind, out, inp, group, tag)


class _P2PCollective:
    """A collective as one batch of P2P transfers with every peer; ``wait`` finishes it."""

    def __init__(self, kind: str, out: torch.Tensor, inp: torch.Tensor, group, tag: int):
        w, r = group.size(), group.rank()
        self.kind, self.out, self.rank = kind, out, r
        outs, ins = out.chunk(w) if kind != "reduce_scatter" else None, inp.chunk(w)
        if kind == "all_gather":  # my input to everyone, everyone's into its chunk of out
            outs[r].copy_(inp)
            sends, recvs = [inp] * w, list(outs)
        elif kind == "all_to_all":  # my chunk p to rank p, rank q's chunk for me into out[q]
            outs[r].copy_(ins[r])
            sends, recvs = list(ins), list(outs)
        else:  # reduce_scatter: my partial of chunk p to rank p; theirs of mine, summed later
            sends = list(ins)
            recvs = [torch.empty_like(out) if p != r else ins[r] for p in range(w)]
        self.parts = recvs
        ops = []
        for p in range(w):
            if p != r:
                peer = dist.get_global_rank(group, p)
                ops += [dist.P2POp(dist.isend, sends[p], peer, group, tag),
                        dist.P2POp(dist.irecv, recvs[p], peer, group, tag)]
        self.works = _p2p.post(ops, out.device) if ops else []

    def wait(self, timeout=None) -> bool:
        for w in dict.fromkeys(self.works):  # NCCL may hand one work for the whole batch
            w.wait(timeout) if timeout is not None else w.wait()
        if self.kind == "reduce_scatter":
            acc = self.parts[0].clone() if len(self.parts) > 1 else self.parts[0]
            for part in self.parts[1:]:
                acc.add_(part)  # rank order, own partial included: deterministic
            self.out.copy_(acc)
        return True

"""One step's routing for the deduplicated dispatch: each (token, destination rank) pair
moves once, the expert rank expands it to its experts' rows and sums their weighted
outputs into one row per pair, which the combine moves back (`commfuse.schedule.moe`'s
dedup layouts).

`plan` (on every rank, for its own tokens) sorts each token's rows by expert and marks, per
(token, rank), the first and the last of its experts there; one all-gather then makes the
`ExpertCounts` table every rank holds (one transfer to the host per layer: the only one).
`to_experts` moves each row's routing (which moved row it expands, where its token's sum
goes, its place in top-k order, its weight) to the expert rank, with the weights' gradient
coming back in the backward; `home_sum` adds a token's per-rank rows in top-k order.

Legend: T tokens, k experts per token, E experts in all (E_l per rank), R expanded rows.
All index work runs on the tensors' device; no data-dependent shape is read from it but the
counts.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commfuse.errors import CommFuseError
from commfuse.ops.moe.counts import CountsError
from commfuse.ops.moe.gemm import device_ints
from commfuse.runtime import gloo
from commfuse.runtime.collectives import exchange
from commfuse.schedule.moe import ExpertCounts

_FIRST, _LAST = 1, 2  # class bits of an expanded row (module doc of commfuse.schedule.moe)


@dataclass
class Routing:
    """The index tensors the dedup bindings read (`commfuse.ops.moe.bindings`).

    ``src_first`` [R]: for each expanded received row, its moved row (dispatch order) in
    the received rows; ``gather_last`` [U, kk]: for each received pair (combine order), its
    expanded rows in top-k order, padded with R (a zero row); ``last_of_first`` [T_u]: for
    each of this rank's moved rows in dispatch order, its place in combine order."""

    src_first: torch.Tensor
    gather_last: torch.Tensor
    last_of_first: torch.Tensor


@dataclass
class Plan:
    """This rank's side of a step (`plan`): the table, the rows it moves (``first_tokens``:
    the token of each moved row, dispatch order), each expanded row's routing to send
    (``meta`` [rows, 3] in send order, ``order`` the flat (t, j) of each), the home sum's
    index ``home`` [T, min(k, W)] into the combine output (T_u: a zero row) and
    ``last_of_first``."""

    counts: ExpertCounts
    k: int
    first_tokens: torch.Tensor
    order: torch.Tensor
    meta: torch.Tensor
    home: torch.Tensor
    last_of_first: torch.Tensor


def plan(experts_Tk: torch.Tensor, experts: int, group: dist.ProcessGroup,
         timeout: float | None = None, layer: tuple = (),
         keep_Tk: torch.Tensor | None = None) -> Plan:
    """Sort this rank's (token, expert) rows and exchange the counts: one all-gather of
    3 + 4E ints per rank (``experts`` = E), read on the host once. ``keep_Tk`` (bool, None:
    every row): the rows that move; the others are dropped (not sent, not counted; a token
    whose every row is dropped sums to zero). The first call per group,
    E and ``layer`` (what identifies the layer alike on every rank: its weights' shapes)
    checks first that every rank has that E (`_agree_experts`). `CountsError` on every
    rank if the ranks' E differ or a rank routed to an expert outside [0, E);
    `CommFuseError` if an exchange fails or outlives ``timeout``."""
    w, me = group.size(), group.rank()
    if experts % w:
        raise ValueError(f"{experts} experts cannot be split over {w} ranks")
    _agree_experts((experts, *layer), group, timeout, experts_Tk.device)
    local, dev = experts // w, experts_Tk.device
    T, k = experts_Tk.shape
    bad = ((experts_Tk < 0) | (experts_Tk >= experts)).any()
    e, q, same, first, last, kept = marks(experts_Tk, experts, w, keep_Tk)
    before = torch.ones(k, k, dtype=torch.bool, device=dev).tril(-1)  # [j, j']: j' < j
    ordinal = (same & before).sum(-1)  # place among the token's experts on that rank
    lead = kept & (ordinal == 0)  # the pair's first row in top-k order
    rank_ord = (lead.unsqueeze(1) & before).sum(-1)  # the pair's place among the token's ranks
    # expanded order: by expert (dropped rows after every expert), then middle / first-only /
    # single / last-only, then token
    cls = torch.where(first & last, 2, torch.where(first, 1, torch.where(last, 3, 0)))
    tok = torch.arange(T, device=dev).unsqueeze(1).expand(T, k)
    e_sort = torch.where(kept, e, experts)
    order = torch.sort(((e_sort * 4 + cls) * max(T, 1) + tok).reshape(-1), stable=True).indices
    tables = torch.zeros(4, experts, dtype=torch.long, device=dev)
    for i, v in enumerate((kept.long(), first.long(), last.long(), (first & last).long())):
        tables[i].index_add_(0, e.reshape(-1), v.reshape(-1))
    header = torch.stack([bad.long(), torch.tensor(T * k, device=dev), torch.tensor(k, device=dev)])
    try:
        every = torch.stack(exchange(torch.cat([header, tables.reshape(-1)]), group, timeout))
    except Exception as err:
        raise CommFuseError(f"commfuse moe (rank {me} of {w}) failed exchanging the expert "
                            f"counts: {type(err).__name__}: {err}") from err
    every = every.tolist()  # the layer's one transfer to the host
    wrong = [p for p in range(w) if every[p][0]]
    if wrong:
        raise CountsError(f"commfuse moe (rank {me} of {w}): ranks {wrong} route to experts "
                          f"outside [0, {experts})")
    cut = [[tuple(row[3 + i * experts:3 + (i + 1) * experts]) for row in every]
           for i in range(4)]
    counts = ExpertCounts(*(tuple(t) for t in cut))
    kmax = max(row[2] for row in every)
    t_u = counts.dispatched(me)
    order = order[:sum(counts.tokens[me])]  # the kept rows (the dropped sort last)
    flat_first = order[torch.sort((~first.reshape(-1)[order]).to(torch.int8),
                                  stable=True).indices[:t_u]]
    flat_last = order[torch.sort((~last.reshape(-1)[order]).to(torch.int8),
                                 stable=True).indices[:t_u]]
    # each (t, j)'s pair: its place in dispatch (first) and combine (last) order
    pair_first = _pair_pos(flat_first, first, same, T, k)
    pair_last = _pair_pos(flat_last, last, same, T, k)
    pairs_q = tables[1].view(w, local).sum(1)
    start_q = pairs_q.cumsum(0) - pairs_q  # where slot q starts in this rank's moved rows
    meta = torch.stack([pair_first - start_q[q], pair_last - start_q[q], ordinal], -1)
    kw = min(k, w)
    home = torch.full((T, kw + 1), t_u, dtype=torch.long, device=dev)
    home.scatter_(1, torch.where(lead, rank_ord, kw), pair_last)  # column kw: discarded
    return Plan(counts, kmax, flat_first // k, order, meta.reshape(-1, 3)[order],
                home[:, :kw], pair_last.reshape(-1)[flat_first])


def marks(experts_Tk: torch.Tensor, experts: int, world: int,
          keep_Tk: torch.Tensor | None = None):
    """Each (token, j)'s expert ``e`` [T, k] (clamped into [0, E)), its rank ``q``, ``same``
    [T, k, k] (j and j' kept and on one rank), whether it is the token's ``first`` / ``last``
    kept expert on that rank by local index (the dispatch moves the first rows, one per
    (token, destination rank); the combine returns on the last), and ``kept`` [T, k]
    (``keep_Tk``, all True when None: a dropped row moves nowhere)."""
    local = experts // world
    e = experts_Tk.clamp(0, experts - 1).long()
    kept = torch.ones_like(e, dtype=torch.bool) if keep_Tk is None else keep_Tk.bool()
    q, li = e // local, e % local
    # [T, k, k]: j and j' kept and on one rank
    same = (q.unsqueeze(2) == q.unsqueeze(1)) & kept.unsqueeze(2) & kept.unsqueeze(1)
    first = kept & ~(same & (li.unsqueeze(1) < li.unsqueeze(2))).any(-1)
    last = kept & ~(same & (li.unsqueeze(1) > li.unsqueeze(2))).any(-1)
    return e, q, same, first, last, kept


_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> E agreed on


def _agree_experts(key: tuple, group, timeout, device) -> None:
    """The first time a group plans a layer (``key``: E, then the layer's shapes): one
    all-gather of E, `CountsError` on every rank if the ranks count different numbers
    (their tables would not fit one message); later calls with it cost nothing. Whether a
    call exchanges depends on the ranks' configuration only, so ranks configured alike
    exchange (or not) alike."""
    done = _AGREED.setdefault(group, set())
    if key in done or group.size() == 1:
        return
    experts = key[0]
    mine = torch.tensor([experts], dtype=torch.long, device=device)
    try:
        every = torch.cat(exchange(mine, group, timeout)).tolist()
    except Exception as err:
        raise CommFuseError(f"commfuse moe (rank {group.rank()} of {group.size()}) failed "
                            f"exchanging the number of experts: {type(err).__name__}: {err}"
                            ) from err
    if len(set(every)) > 1:
        raise CountsError(f"commfuse moe (rank {group.rank()} of {group.size()}): the ranks "
                          f"count different numbers of experts: "
                          + ", ".join(f"rank {p}: {n}" for p, n in enumerate(every)))
    done.add(key)


def _pair_pos(flat_rows: torch.Tensor, mark: torch.Tensor, same: torch.Tensor, T: int,
              k: int) -> torch.Tensor:
    """[T, k]: for each (t, j), the place in ``flat_rows`` (the moved rows in one order,
    flat (t, j) indices) of the row of its pair that ``mark`` flags."""
    pos = torch.zeros(T * k, dtype=torch.long, device=mark.device)
    pos[flat_rows] = torch.arange(flat_rows.numel(), device=mark.device)
    j_mark = (same & mark.unsqueeze(1)).int().argmax(-1)  # the pair's marked j'
    rows = torch.arange(T, device=mark.device).unsqueeze(1) * k + j_mark
    return pos[rows]


class _ToExperts(torch.autograd.Function):
    """Each expanded row's routing and weight to its expert rank (one all-to-all of float64
    [rows, 4]: indices below 2^53 and any float weight are exact in it); backward: the
    weights' grads back to their tokens' ranks (one all-to-all of [rows])."""

    @staticmethod
    def forward(ctx, weights_S, meta_S3, counts, group, timeout):
        me = group.rank()
        send = [counts.rows[me][q] for q in range(counts.world)]
        recv = [counts.rows[p][me] for p in range(counts.world)]
        packed = torch.cat([meta_S3.double(), weights_S.double().unsqueeze(-1)], -1)
        got = _all_to_all(packed, recv, send, group, timeout)
        ctx.sizes, ctx.group, ctx.timeout, ctx.dtype = (send, recv), group, timeout, \
            weights_S.dtype
        meta = got[:, :3].long()
        ctx.mark_non_differentiable(meta)
        return got[:, 3].to(weights_S.dtype), meta

    @staticmethod
    def backward(ctx, g_R, _):
        send, recv = ctx.sizes
        back = _all_to_all(g_R.double().contiguous(), send, recv, ctx.group, ctx.timeout)
        return back.to(ctx.dtype), None, None, None, None


def _all_to_all(inp, out_sizes, in_sizes, group, timeout):
    out = inp.new_empty((sum(out_sizes), *inp.shape[1:]))
    try:
        work = dist.all_to_all_single(out, inp.contiguous(), out_sizes, in_sizes, group=group,
                                      async_op=True)
        seconds = gloo.group_timeout(group, inp.device) if timeout is None else timeout
        gloo.wait_work(work, time.monotonic() + seconds)
    except Exception as err:
        raise CommFuseError(f"commfuse moe (rank {group.rank()} of {group.size()}) failed "
                            f"moving the routing: {type(err).__name__}: {err}") from err
    return out


def to_experts(p: Plan, weights_Tk: torch.Tensor, group: dist.ProcessGroup,
               timeout: float | None = None) -> tuple[torch.Tensor, Routing]:
    """(each expanded received row's weight [R] (autograd: its grad goes home), the
    bindings' `Routing`)."""
    c, me = p.counts, group.rank()
    weights_R, meta = _ToExperts.apply(weights_Tk.reshape(-1)[p.order], p.meta, c, group,
                                       timeout)
    rows, dev = meta.shape[0], meta.device
    slots = [row[me] for row in c.rows]
    starts = [sum(r[me] for r in c.pairs[:i]) for i in range(c.world)]
    ints = device_ints(starts + slots, dev).long()
    at = torch.repeat_interleave(ints[:c.world], ints[c.world:], output_size=rows)
    kk = min(p.k, c.local)
    gather = torch.full((sum(r[me] for r in c.pairs), kk), rows, dtype=torch.long, device=dev)
    gather[meta[:, 1] + at, meta[:, 2]] = torch.arange(rows, device=dev)
    return weights_R, Routing(meta[:, 0] + at, gather, p.last_of_first)


def home_sum(p: Plan, y_UD: torch.Tensor) -> torch.Tensor:
    """[T, D]: each token's rows (one per rank it went to) summed in top-k order."""
    padded = torch.cat([y_UD, y_UD.new_zeros((1, y_UD.shape[1]))])
    return padded[p.home].sum(1)

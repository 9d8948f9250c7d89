"""Memory of one training step on each rank: what the parallel plans are for.

Sequence parallelism exists to divide the activations a rank keeps for backward by the TP
degree, ZeRO-3 to divide the parameters a rank holds by the DP degree; a fused op that saved
its gathered input would undo both. `measure` runs one forward + backward of the Llama under a
layout (after a warm-up step) and reports per rank, in bytes:

- ``params``: this rank's parameters;
- ``held``: what the forward leaves alive for the backward (process bytes in use after the
  forward minus before it, glibc ``mallinfo2``): saved activations, and any gathered weight
  still alive;
- ``saved_acts`` / ``saved_params``: the distinct storages the forward saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``), not / only parameters (a cross-check of
  ``held``; a weight that `commfuse.parallel.data.regathered` saves as its shard is not seen);
- ``wide``: of those, the storages saved as a [batch, whole sequence, model width] tensor,
  which under TPSP only a gathered input is (between the blocks the sequence is sharded,
  inside them the width is);
- ``peak``: ``params`` plus the peak of the bytes in use during forward + backward above
  those before it, sampled after every module's forward, every GEMM, post and wait of the
  fused ops' schedules (`commfuse.bench.memory`) and every autograd node of the backward. (A
  ``TorchDispatchMode`` sampling after every op changed what it measured: the forward kept
  12x more under it.)

``keep_gathered=True`` makes every all-gather -> GEMM of the plans save its gathered input
(``save_gathered=True``) and turns off `regathered` and the ZeRO-3 prefetch (whose forward
does not go through those ops): the behaviour the plans must not have,
measured to show that the bounds discriminate. ``python -m commfuse.bench.step_memory`` prints
the table.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
from commfuse.bench.memory import AVAILABLE, _sampling, in_use

# a model whose weights outweigh its activations at these token counts (ZeRO-3's regime)
CFG = dict(vocab_size=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=1024,
           max_seq_len=64)
BATCH, SEQ = 2, 32
LAYOUTS = {"single": {}, "tp2": {"tp": 2}, "dp2": {"dp": 2}, "tp2xdp2": {"tp": 2, "dp": 2},
           # ZeRO-3 prefetch (`commfuse.parallel.prefetch`) on a deeper model: one block
           # ahead (the default), off, and every block ahead (past any bound)
           "dp2-pf0": {"dp": 2, "prefetch": 0},
           "dp2-deep": {"dp": 2}, "dp2-deep-pf0": {"dp": 2, "prefetch": 0},
           "dp2-deep-pfall": {"dp": 2, "prefetch": 8}}
MODEL_OF = {name: {"n_layers": 6} for name in LAYOUTS if "-deep" in name}  # CFG overrides


@contextlib.contextmanager
def _sampling_forward(samples: list[int]):
    """Sample `in_use` after every module's forward and every GEMM, post and wait."""
    def hook(*_):
        samples.append(in_use())

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        with _sampling(samples):
            yield
    finally:
        handle.remove()


def _sample_backward(loss: torch.Tensor, samples: list[int]) -> None:
    """Sample `in_use` after every autograd node of ``loss``'s graph runs."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_hook(lambda *_: samples.append(in_use()))
        todo += [nxt for nxt, _ in node.next_functions]


@contextlib.contextmanager
def _saved_storages(acts: dict, params: dict, param_ptrs: set, wide: dict, wide_shape):
    """Record every storage saved for backward inside: data pointer -> bytes; in ``wide``
    those saved as a tensor of ``wide_shape``."""
    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        (params if st.data_ptr() in param_ptrs else acts)[st.data_ptr()] = st.nbytes()
        if tuple(t.shape) == wide_shape:
            wide[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


@contextlib.contextmanager
def _keeping_gathered():
    """The plans as they must not be: gathered inputs and weights saved for backward."""
    from commfuse.ops import fused
    from commfuse.parallel import data, tensor, ulysses

    keep = functools.partial(fused.fused_all_gather_matmul, save_gathered=True)

    @contextlib.contextmanager
    def plain(*mods):
        yield [m.gather() for m in mods]

    saved = [(m, n, getattr(m, n)) for m, n in ((data, "fused_all_gather_matmul"),
                                                (tensor, "fused_all_gather_matmul"),
                                                (tensor, "regathered"), (ulysses, "regathered"))]
    data.fused_all_gather_matmul = tensor.fused_all_gather_matmul = keep
    tensor.regathered = ulysses.regathered = plain
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def measure(rank: int, world: int, layout: dict, keep_gathered: bool = False,
            method: str = "commfuse", cfg: dict | None = None) -> dict[str, int]:
    """One step's memory on this rank (see the module docstring); run under `run_local`."""
    from commfuse.models.llama import Llama, LlamaConfig
    from commfuse.parallel import ParallelDims, parallelize

    cfg = {**CFG, **(cfg or {})}
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**cfg))
    if keep_gathered and layout:  # what is kept is the fused ops' (ZeRO-3 prefetch takes other paths)
        layout = {**layout, "prefetch": 0}
    dims = ParallelDims(**layout, method=method) if layout else None
    pmodel = parallelize(model, dims)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg["vocab_size"], (BATCH, SEQ), generator=g)
    dp = dims.dp if dims else 1
    rows = slice(0, BATCH // dp)  # the data a DP rank gets: its share of the batch
    with _keeping_gathered() if keep_gathered else contextlib.nullcontext():
        pmodel.loss(tokens[rows], tokens[rows]).backward()  # warm-up: lazy state, threads
        for p in pmodel.parameters():
            p.grad = None
        params = list(pmodel.parameters())
        param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        acts, saved_params, wide = {}, {}, {}
        wide_shape = (rows.stop - rows.start, SEQ, cfg["dim"])
        samples: list[int] = []
        gc.collect()
        base = in_use()
        with _sampling_forward(samples), _saved_storages(acts, saved_params, param_ptrs, wide,
                                                              wide_shape):
            loss = pmodel.loss(tokens[rows], tokens[rows])
        held = in_use() - base
        _sample_backward(loss, samples)
        with _sampling(samples):
            loss.backward()
        del loss
    peak = max(samples + [base + held]) - base
    n = sum(p.numel() * p.element_size() for p in params)
    return {"params": n, "held": held, "saved_acts": sum(acts.values()),
            "saved_params": sum(saved_params.values()), "wide": sum(wide.values()),
            "peak": n + peak}


def measure_many(rank: int, world: int, cases) -> dict:
    """`measure` of each ``(layout name, keep_gathered)`` in ``cases`` on this rank, in one
    process (``"single"`` runs alone on every rank)."""
    return {(name, keep): measure(rank, world, LAYOUTS[name], keep, cfg=MODEL_OF.get(name))
            for name, keep in cases}


def run(cases) -> dict[tuple[str, bool], dict[str, int]]:
    """The worst rank's `measure` for each ``(layout name, keep_gathered)`` (names of
    `LAYOUTS`), on local gloo ranks: one spawn per world size, ``"single"`` with the smallest."""
    from commfuse.testbed.spawn import run_local

    by_world: dict[int, list] = {}
    for name, keep in cases:
        world = 1
        for axis in ("tp", "up", "dp"):
            world *= LAYOUTS[name].get(axis, 1)
        by_world.setdefault(world, []).append((name, keep))
    if 1 in by_world and len(by_world) > 1:
        by_world[min(w for w in by_world if w > 1)] += by_world.pop(1)
    out = {}
    for world, group in by_world.items():
        res = run_local(measure_many, world, group, timeout=300)
        out.update({key: {k: max(r[key][k] for r in res) for k in res[0][key]} for key in group})
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m commfuse.bench.step_memory",
                                description="Per-rank memory of one training step of a small "
                                            "Llama under each layout (float32, local gloo "
                                            "ranks), worst rank, as a fraction of one process.")
    p.parse_args(argv)
    if not AVAILABLE:
        print("needs glibc's mallinfo2 (glibc >= 2.33)")
        return 1
    cases = [("single", False)] + [(n, k) for n in LAYOUTS if n != "single" for k in (False, True)]
    res = run(cases)
    keys = ("params", "held", "saved_acts", "params+held", "peak")
    for r in res.values():
        r["params+held"] = r["params"] + r["held"]
    base = res[("single", False)]
    print(f"model {CFG}, batch {BATCH} x {SEQ} tokens (dp ranks: their share); KiB, and x one "
          "process\n| layout | gathered kept | " + " | ".join(keys) + " |\n|---|---|"
          + "---|" * len(keys))
    for name, keep in cases:
        print(f"| {name} | {'yes' if keep else 'no'} | " + " | ".join(
            f"{res[(name, keep)][k] / 1024:.0f} ({res[(name, keep)][k] / base[k]:.2f})"
            for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

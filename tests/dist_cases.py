"""Multi-rank exactness cases: every op and method against an unsharded reference.

Every rank rebuilds *all* ranks' inputs from the case's seed, computes the whole unsharded
problem in float64 in one process (the reference), runs the fused op on its own inputs, and
compares outputs and gradients of A and every B. Runs inside `commfuse.testbed.spawn.run_local`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

import commfuse
from commfuse.ops import registry
from commfuse.schedule import OPS, VARIANTS


def variants(*items) -> tuple[tuple[str, dict], ...]:
    """(method, opts) pairs from labels of the package's `VARIANTS` and from pairs of its own:
    what only the tests try (defaults, other chunks, topologies and splits)."""
    return tuple(VARIANTS[v] if isinstance(v, str) else v for v in items)


METHODS = variants("none", "none-torch", ("sliced", {"chunks": 2}), ("sliced", {}),
                   ("sliced", {"collective": "backend"}),
                   "decompose", ("decompose", {"topology": "direct"}),
                   "commfuse", "commfuse-direct",
                   ("decompose", {"splits": 2}), "commfuse-m2",
                   ("commfuse", {"topology": "direct", "splits": 4}), "auto")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # norm-relative error vs float64 reference


@dataclass(frozen=True)
class Case:
    op: str
    method: str
    opts: tuple
    dim: int
    dtype: torch.dtype
    noncontig: bool = False
    avg: bool = False
    uneven: str = ""  # "" even slices; see UNEVEN
    return_a: bool = True  # ag_matmul: A is returned (and gets a gradient)

    def sizes(self, world: int) -> tuple[int, ...]:
        """Rows of each rank's slice of the gathered/scattered dim."""
        if self.uneven == "skewed":  # explicit, not the default split
            return tuple(S - 1 if p % 2 == 0 else S + 2 for p in range(world))
        total = {"": world * S, "short": world * S - 1, "tiny": world - 1,
                 "sparse": 2}[self.uneven]
        return commfuse.even_sizes(total, world)

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.opts)
        return (f"{self.op}-{self.method}{'[' + opts + ']' if opts else ''}-dim{self.dim}-"
                f"{str(self.dtype)[6:]}{'-noncontig' if self.noncontig else ''}"
                f"{'-avg' if self.avg else ''}{'-' + self.uneven if self.uneven else ''}"
                f"{'' if self.return_a else '-noA'}")


def all_cases() -> list[Case]:
    cases = []
    for op in OPS:
        for method, opts in METHODS:
            o = tuple(sorted(opts.items()))
            for dim in (0, 1):
                for dtype in (torch.float32, torch.bfloat16):
                    cases.append(Case(op, method, o, dim, dtype))
            cases.append(Case(op, method, o, 1, torch.float32, noncontig=True,
                              avg=op == "matmul_rs"))
            for uneven in UNEVEN:
                cases.append(Case(op, method, o, 1, torch.float32, avg=op == "matmul_rs",
                                  uneven=uneven))
            if op == "ag_matmul":  # only Ys used (A's grad is None); the gathered A saved
                cases.append(Case(op, method, o, 1, torch.float32, return_a=False))
                o2 = tuple(sorted({**opts, "save_gathered": True}.items()))
                cases += [Case(op, method, o2, 1, torch.float32, return_a=False),
                          Case(op, method, o2, 0, torch.bfloat16),
                          Case(op, method, o2, 1, torch.float32, uneven="skewed")]
    return cases


UNEVEN = ("short", "tiny", "skewed")  # W*S-1 rows (even_sizes); W-1 rows (one rank has none);
# explicit sizes alternating S-1, S+2; "sparse" (2 rows: on 4 ranks some steps move
# nothing either way) is run by tests/test_cuda_order.py


S, MID, K, N = 3, 5, 7, 3  # per-rank slice, other leading dim, contraction, columns per rank


def _shape(dim: int, seq: int, last: int) -> tuple[int, ...]:
    return (seq, MID, last) if dim == 0 else (MID, seq, last)


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, reversed memory layout (a non-contiguous view)."""
    out = torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).permute(*reversed(range(t.dim())))
    return out.copy_(t)


def _inputs(case: Case, world: int):
    """Every rank's inputs and upstream grads, in float64, from the case's seed."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + world)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    d, w, sizes, op = case.dim, world, case.sizes(world), case.op
    a = [rnd(*_shape(d, registry.a_rows(op, sizes, p), K)) for p in range(w)]
    if registry.get(op).replicated_b:
        b0 = rnd(*registry.b_shape(op, w, K, N))
        b = [[b0.clone()] for _ in range(w)]  # one leaf per rank
    else:  # ag_matmul takes two Bs (of different widths)
        b = [[rnd(K, N), rnd(K, N + 2)] if op == "ag_matmul" else [rnd(K, N)] for _ in range(w)]
    return a, b, g


def _reference(case: Case, world: int, a, b):
    """Outputs per rank as a list of tensors (float64, differentiable in a and b)."""
    d, w, sizes = case.dim, world, case.sizes(world)
    offs = [sum(sizes[:p]) for p in range(w)]
    if case.op == "ag_matmul":
        full = torch.cat(a, d)
        return [[full] * case.return_a + [full @ bi for bi in b[r]] for r in range(w)]
    if case.op == "matmul_rs":
        c = sum(a[q] @ b[q][0] for q in range(w))
        if case.avg:
            c = c / w
        return [[c.narrow(d, offs[r], sizes[r])] for r in range(w)]
    if case.op == "matmul_a2a":
        p = [a[q] @ b[q][0] for q in range(w)]
        return [[torch.cat([p[q][..., r * N:(r + 1) * N] for q in range(w)], d)] for r in range(w)]
    x = [torch.cat([a[q].narrow(d, offs[r], sizes[r]) for q in range(w)], -1) for r in range(w)]
    return [[x[r] @ b[r][0]] for r in range(w)]


def _fused(case: Case, a: torch.Tensor, bs: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    opts = dict(case.opts)
    if case.uneven in ("skewed",) or (case.uneven and not registry.get(case.op).whole_input):
        opts["sizes"] = case.sizes(world)  # else the default: even_sizes of the full dim
    return registry.outputs(case.op, a, bs, case.method, opts, dim=case.dim,
                            reduce_op="avg" if case.avg else "sum", return_A=case.return_a)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(case: Case, rank: int, world: int, device: str = "cpu") -> str | None:
    """None if this rank's outputs and gradients match the reference, else what differs."""
    a64, b64, g = _inputs(case, world)
    for t in [*a64, *(t for bs in b64 for t in bs)]:
        t.requires_grad_()
    outs_ref = _reference(case, world, a64, b64)
    grads_out = [[torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
                 for outs in outs_ref]
    loss = sum((o * go).sum() for outs, gos in zip(outs_ref, grads_out) for o, go in zip(outs, gos))
    loss.backward()

    def run():
        conv = (lambda t: _noncontig(t.detach().to(case.dtype)).to(device)) if case.noncontig \
            else (lambda t: t.detach().to(case.dtype).to(device))
        a = conv(a64[rank]).requires_grad_()
        bs = [conv(t).requires_grad_() for t in b64[rank]]
        outs = _fused(case, a, bs, world)
        sum((o * go.to(device, case.dtype)).sum() for o, go in zip(outs, grads_out[rank])).backward()
        return [o.detach() for o in outs], a.grad, [t.grad for t in bs]

    outs, ga, gbs = run()
    problems = []
    tol = TOL[case.dtype]
    named = [(f"output {i}", o, r) for i, (o, r) in enumerate(zip(outs, outs_ref[rank]))]
    named += [("grad A", ga, a64[rank].grad)]
    named += [(f"grad B{i}", gb, r.grad) for i, (gb, r) in enumerate(zip(gbs, b64[rank]))]
    for name, x, ref in named:
        if x is None or x.shape != ref.shape:
            problems.append(f"{name}: shape {None if x is None else tuple(x.shape)} != {tuple(ref.shape)}")
        elif x.dtype != case.dtype:
            problems.append(f"{name}: dtype {x.dtype}")
        elif (e := _rel(x, ref.detach())) > tol:
            problems.append(f"{name}: relative error {e:.2e} > {tol:.0e}")
    outs2, ga2, gbs2 = run()  # the same call again: bitwise identical
    for name, x, y in zip(["outputs", "grad A", "grad B"], [outs, [ga], gbs], [outs2, [ga2], gbs2]):
        if not all(torch.equal(p, q) for p, q in zip(x, y)):
            problems.append(f"{name} not bitwise identical on repeat")
    return "; ".join(problems) or None


def run_cases(rank: int, world: int, cases: list[Case], device: str = "cpu") -> dict[str, str | None]:
    results = {}
    for case in cases:
        try:
            results[case.id] = check(case, rank, world, device)
        except Exception as e:  # report the case, keep going: other ranks run it too
            results[case.id] = f"raised {type(e).__name__}: {e}"
    return results

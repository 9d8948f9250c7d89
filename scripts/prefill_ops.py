"""Prefill (`commfuse.infer.InferenceLlama`) against the training forward (`commfuse.parallel`,
TPSP blocks, no grad) of preset small on the same tokens per rank, per method, per op.

Each fused op call is timed and recorded as it runs (which op of the block, the method, ring /
direct, chunks or m, the gathered / scattered shape), and so is SDPA; "other" is the rest
(norms, RoPE, cache writes, embedding, head). Every method, both kinds, interleaved after a
warm-up round, medians of ITERS rounds, both ranks. Run as 2 ranks on the emulated cluster:

    ITERS=3 SHAPES=1x2048,4x512 OUT=diag.json commfuse launch --nproc 2 --link 1gbit -- \
        python scripts/prefill_ops.py

SHAPES: BxS (sequences x tokens); METHODS (default all five); FB=1 adds forward+backward;
QS=1: the prefill runs query-split attention (its RS is the "out" op, SDPA inside it).
HW: auto's hardware model, "measured" (`commfuse.ops.auto.calibrate`) or a preset name
(default: the preset, `cpu-testbed`).
(docs/benchmarks/2026-12-01-inference.md, "Second session".)
"""
import collections, copy, json, os, statistics, time
import torch, torch.distributed as dist
import torch.nn.functional as F

dist.init_process_group("gloo")
from commfuse.runtime.gloo import duplex
duplex()
rank, world = dist.get_rank(), dist.get_world_size()
from commfuse.models.llama import Llama, LlamaConfig, rope_cos_sin
from commfuse.parallel import ParallelDims, parallelize
from commfuse.infer.model import InferenceLlama
from commfuse.ops import binding as B_
from commfuse.runtime import modes

if os.environ.get("HW"):  # auto's hardware model: "measured" (fitted here) or a preset name
    from commfuse.ops.auto import use_hardware
    print(use_hardware(os.environ["HW"], torch.empty(0))[1], flush=True)
ITERS = int(os.environ.get("ITERS", "3"))
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "1x2048,4x512").split(",")]
METHODS = os.environ.get("METHODS", "none,sliced,decompose,commfuse,auto").split(",")
import dataclasses
cfg = dataclasses.replace(LlamaConfig.preset("small"), max_seq_len=8192)
torch.manual_seed(0)
base = Llama(cfg)
QS = bool(os.environ.get("QS"))  # prefill with query-split attention (balanced order)
inf = InferenceLlama(copy.deepcopy(base), dist.group.WORLD, "none", query_split=QS)
tm = copy.deepcopy(base)
pm = parallelize(tm, ParallelDims(tp=world, method="none"))
tmods = [m for m in pm.modules() if hasattr(m, "op_kwargs")]

# per-op timing and schedule record
rec = None
nop = 0
orig_exec = B_.execute
def execute(op, spec, group, binding, device, after_posts=None):
    t0 = time.perf_counter()
    orig_exec(op, spec, group, binding, device, after_posts)
    dt = time.perf_counter() - t0
    if rec is not None:
        shp = tuple(getattr(binding, "a_SMK", None).shape) if op == "ag_matmul" else tuple(binding.out_sMN.shape)
        global nop
        lab = ["qkv", "out", "gate|up", "down"][nop % 4]; nop += 1
        key = (lab, op, spec.method, spec.topology if spec.method in ("decompose", "commfuse") else "",
               binding.m if not binding.pieces else len(binding.pieces[0]), shp)
        rec[key].append(dt)
B_.execute = execute
import commfuse.ops.ag_matmul as AGM, commfuse.ops.matmul_rs as MRS
AGM.execute = execute; MRS.execute = execute
orig_sdpa = F.scaled_dot_product_attention
def sdpa(*a, **k):
    t0 = time.perf_counter(); o = orig_sdpa(*a, **k)
    if rec is not None: rec[("sdpa", tuple(a[0].shape))].append(time.perf_counter() - t0)
    return o
F.scaled_dot_product_attention = sdpa

def set_train_method(m):
    for mod in tmods: mod.op_kwargs["method"] = m

def train_fwd(x_BsD, cos, sin, grad):
    with torch.set_grad_enabled(grad):
        x = x_BsD.requires_grad_(grad) if grad else x_BsD
        for layer in pm.model.layers:
            x = layer(x, cos, sin)
        if grad:
            x.sum().backward()
    return x

results = []
for (Bt, S) in SHAPES:
    tokens = torch.randint(0, cfg.vocab_size, (Bt, S), generator=torch.Generator().manual_seed(1))
    s = S // world
    cos, sin = rope_cos_sin(S, cfg.head_dim, cfg.rope_theta, None, cfg.rope_scaling)
    x_BsD = torch.randn(Bt, s, cfg.dim, generator=torch.Generator().manual_seed(2 + rank))
    lengths = torch.full((Bt,), S)
    runs = {}
    def prefill(m):
        inf.method = m
        cache = inf.new_cache(Bt, S + 1)
        inf.prefill(tokens, lengths, cache)
    def tfwd(m):
        set_train_method(m)
        with torch.no_grad():
            train_fwd(x_BsD.clone(), cos, sin, False)
    def tfb(m):
        set_train_method(m)
        train_fwd(x_BsD.clone(), cos, sin, True)
    kinds = [("prefill", prefill), ("train_fwd", tfwd)]
    if os.environ.get("FB"): kinds.append(("train_fwd_bwd", tfb))
    labels = [(m, m, "normal") for m in METHODS] + [("compute alone", "none", "compute_only")]
    times = collections.defaultdict(list); ops = {}
    for it in range(ITERS + 1):
        for kname, fn in kinds:
            for lab, m, md in labels:
                rec = collections.defaultdict(list) if it else None
                nop = 0
                dist.barrier()
                t0 = time.perf_counter()
                with modes.mode(md):
                    fn(m)
                dt = time.perf_counter() - t0
                if it:
                    times[(kname, lab)].append(dt)
                    ops.setdefault((kname, lab), []).append(rec)
    rec = None
    for (kname, lab), ts in times.items():
        med = statistics.median(ts) * 1e3
        # per-op: median over iterations of total per key
        per = collections.defaultdict(list)
        for r in ops[(kname, lab)]:
            for k, v in r.items(): per[k].append(sum(v) * 1e3)
        opsum = {" ".join(map(str, k)): (len(ops[(kname, lab)][0][k]), round(statistics.median(v), 1)) for k, v in per.items()}
        results.append({"B": Bt, "S": S, "kind": kname, "method": lab, "ms": med, "ops": opsum})
allres = [None] * world
dist.all_gather_object(allres, results)
if rank == 0:
    none = {(r["B"], r["S"], r["kind"]): r["ms"] for r in results if r["method"] == "none"}
    for r in results:
        print(f"{r['B']}x{r['S']} {r['kind']:<14} {r['method']:<14} {r['ms']:8.1f} {r['ms']/none[(r['B'], r['S'], r['kind'])]:.3f}")
    for r, r1 in zip(results, allres[1]):
        tot = sum(v[1] for v in r["ops"].values())
        print(f"--- {r['B']}x{r['S']} {r['kind']} {r['method']}  total {r['ms']:.1f}  other {r['ms'] - tot:.1f} (rank1 total {r1['ms']:.1f})")
        for k, v in sorted(r["ops"].items()): print("   ", k, v, "rank1", r1["ops"].get(k))
    json.dump(allres, open(os.environ.get("OUT", "/tmp/diag.json"), "w"), indent=1)
dist.destroy_process_group()

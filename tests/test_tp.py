"""commfuse.tp against the unsharded transformers model (tiny random configs, float32, gloo).

One spawn per world size runs every case: each rank builds the reference model from the seed,
computes its logits, loss and gradients in one process, then parallelizes a copy with
`commfuse.tp.parallelize` and compares logits, loss and every parameter's full gradient
(``grad.full_tensor()``); training runs 8 AdamW steps of both on 2 ranks and compares the
losses; the FSDP2 case (4 ranks) trains over "dp" of a 2 x 2 mesh with commfuse TP over "tp".
"""

import copy
import functools

import pytest
import torch
from torch import nn

from commfuse.testbed.spawn import run_local

CFG = dict(vocab_size=63, hidden_size=32, intermediate_size=42, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
           tie_word_embeddings=False)  # vocab 63, ffn 42: uneven column shards on 2 and 4 ranks
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),  # q_norm / k_norm
         "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True,
                                                            "mlp_bias": True})}
METHODS = {"none": {}, "sliced": {"chunks": 2}, "commfuse": {}, "commfuse-direct":
           {"topology": "direct"}, "auto": {}, "commfuse-keep": {"save_gathered": True},
           "commfuse-lp": {"loss_parallel": True}}  # lp: vocabulary-sharded logits and loss
TOL = {"f32": 1e-5, "bf16": 3e-2}  # norm-relative vs the float32 model, as tests/test_parallel.py
# (arch, method, attention, sequence length): 11 tokens split unevenly over 2 and 4 ranks
EXACT = ([(a, m, "sdpa", 11) for a in ("llama", "qwen2") for m in METHODS
          if a == "llama" or m in ("none", "commfuse", "auto")]
         + [("llama", "commfuse", "eager", 16), ("qwen3", "commfuse", "sdpa", 11),
            ("qwen3", "none", "eager", 8), ("llama-bias", "commfuse", "sdpa", 11),
            ("llama", "commfuse", "sdpa", "11-bf16")])  # the sharded model in bfloat16
# on 2 ranks (a step is the same code on 4: EXACT's gradients there, and FSDP2's steps)
TRAIN = [("llama", "none"), ("llama", "commfuse"), ("llama", "auto"), ("qwen2", "commfuse")]
STEPS, BATCH = 8, 4  # steps: the loss of each must match and fall by 0.5 over them


def build(arch: str, attn: str = "sdpa", seed: int = 0):
    import transformers
    cfg_name, model_name, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**CFG, **extra, attn_implementation=attn)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).float()


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _tokens(seed: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(CFG["vocab_size"], (2, batch, seq), generator=g)
    labels[0, 2] = -100  # an ignored position
    return ids, labels


def _full_grad(name: str, p, want_shape, world: int) -> tuple[torch.Tensor, list[str]]:
    """The unsharded gradient of DTensor ``p``; head-replicated k/v weights folded back (and
    their copies checked equal)."""
    g = p.grad.full_tensor()
    if g.shape == want_shape:
        return g, []
    k = g.shape[0] // want_shape[0]
    blocks = g.reshape(world // k, k, -1, *g.shape[1:])
    same = all(torch.equal(blocks[:, 0], blocks[:, i]) for i in range(k))
    return blocks[:, 0].reshape(want_shape), [] if same else [f"{name}: copies' grads differ"]


def outputs_match(got, out, model, ref, tol) -> list[str]:
    """What differs between the sharded ``model``'s output ``got`` and the unsharded ``ref``'s
    ``out``: logits (under ``loss_parallel``, this rank's vocabulary columns of them), loss
    (relative ``tol``) and the parameter names."""
    problems, want_logits = [], out.logits.detach()
    if got.logits.shape[-1] != want_logits.shape[-1]:  # loss_parallel: this rank's columns
        from commfuse.tp.loss import vocab_start
        start = vocab_start(model.lm_head, model.lm_head.weight.device_mesh.get_group())
        want_logits = want_logits[..., start:start + got.logits.shape[-1]]
    if _rel(got.logits.detach(), want_logits) > tol:
        problems.append(f"logits rel {_rel(got.logits.detach(), want_logits):.1e}")
    if abs(got.loss.item() - out.loss.item()) > tol * abs(out.loss.item()):
        problems.append(f"loss {got.loss.item()} vs {out.loss.item()}")
    names = sorted(n for n, _ in model.named_parameters())
    want = sorted(n for n, _ in ref.named_parameters())
    if names != want:
        problems.append(f"parameter names differ: {set(names) ^ set(want)}")
    return problems


def _check_exact(arch, method, attn, seq, mesh) -> list[str]:
    import commfuse.tp as tp
    from torch.distributed.tensor import DTensor
    seq, _, variant = str(seq).partition("-")
    seq, tol = int(seq), TOL[variant or "f32"]
    ref = build(arch, attn)
    model = copy.deepcopy(ref).to(torch.bfloat16 if variant == "bf16" else torch.float32)
    ids, labels = _tokens(seq, 2, seq)
    out = ref(ids, labels=labels)
    out.loss.backward()
    tp.parallelize(model, mesh, method="none" if method == "none" else method.split("-")[0],
                   **METHODS[method])
    got = model(ids, labels=labels)
    got.loss.backward()
    problems = outputs_match(got, out, model, ref, tol)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            problems.append(f"{name} is not a DTensor")
            continue
        g, bad = _full_grad(name, p, want[name].grad.shape, mesh.size())
        problems += bad
        if _rel(g, want[name].grad) > tol:
            problems.append(f"grad {name} rel {_rel(g, want[name].grad):.1e}")
    return problems


def _train(model, mesh_dp, ids, labels, steps) -> list[float]:
    """Losses of ``steps`` AdamW steps (the dp rank's rows of each batch; the loss averaged
    over dp when ``mesh_dp`` is given)."""
    import torch.distributed as dist
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        loss = model(ids[step], labels=labels[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if mesh_dp is not None:
            dist.all_reduce(loss, group=mesh_dp.get_group())
            loss /= mesh_dp.size()
        losses.append(loss.item())
    return losses


def _batches(steps: int, seq: int = 12):
    """Two batches taken in turn (so the loss falls), labels the next token."""
    two = torch.randint(CFG["vocab_size"], (2, BATCH, seq), generator=torch.Generator().manual_seed(5))
    ids = two[torch.arange(steps) % 2]
    return ids, ids.roll(-1, 2)


def _check_train(arch, method, mesh) -> list[str]:
    import commfuse.tp as tp
    ids, labels = _batches(STEPS)
    want = _train(build(arch), None, ids, labels, STEPS)
    got = _train(tp.parallelize(build(arch), mesh, method=method), None, ids, labels, STEPS)
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    ok = err < 1e-4 and want[-1] < want[0] - 0.5  # and it learned something
    return [] if ok else [f"losses {got} vs {want} (max rel {err:.1e})"]


def _check_fsdp(method) -> list[str]:
    """FSDP2 (fully_shard over "dp") x commfuse TP (over "tp") on a 2 x 2 mesh vs one process."""
    import commfuse.tp as tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids, labels = _batches(STEPS)
    want = _train(build("llama"), None, ids, labels, STEPS)
    model = tp.parallelize(build("llama"), mesh, method=method)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    half = BATCH // 2
    rows = slice(mesh.get_local_rank("dp") * half, (mesh.get_local_rank("dp") + 1) * half)
    got = _train(model, mesh["dp"], ids[:, rows], labels[:, rows], STEPS)
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return [] if err < 1e-4 else [f"losses {got} vs {want} (max rel {err:.1e})"]


class MLP(torch.nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Block(torch.nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(d), MLP(d, f)

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class Toy(torch.nn.Module):
    """The README's model of one's own: embedding, a residual SwiGLU block (biases), head."""

    def __init__(self, vocab=63, d=32, f=42):
        super().__init__()
        self.emb, self.block = nn.Embedding(vocab, d), Block(d, f)
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.block(self.emb(ids))))


def _check_styles(mesh, method) -> list[str]:
    """`parallelize_module` with the styles on a model of one's own (as in the README)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from commfuse.tp import (FusedColwiseParallel, FusedProjections, FusedRowwiseParallel,
                             ReplicateParallel, SeqSplit, SequenceParallelNorm, ShardSequence)
    torch.manual_seed(0)
    ref = Toy()
    model = copy.deepcopy(ref)
    split = SeqSplit()
    kw = dict(method=method, split=split)
    parallelize_module(model, mesh, {
        "emb": ReplicateParallel(), "block": ShardSequence(split),
        "block.norm": SequenceParallelNorm(True), "norm": SequenceParallelNorm(True),
        "block.mlp": FusedProjections(["gate", "up"], **kw),
        "block.mlp.gate": FusedColwiseParallel(**kw), "block.mlp.up": FusedColwiseParallel(**kw),
        "block.mlp.down": FusedRowwiseParallel(**kw),
        "head": FusedColwiseParallel(gather_output=True, **kw)})
    from commfuse.tp import functional
    ids = _tokens(3, 2, 11)[0]
    want, got = ref(ids), model(ids)
    problems = [] if _rel(got.detach(), want.detach()) <= TOL["f32"] else ["logits"]
    pending = []  # the norms' sums are posted, not waited, where the backward reaches them
    model.block.norm.weight.register_post_accumulate_grad_hook(
        lambda p: pending.append(len(functional._PENDING.sums)))
    for i in range(2):  # the second backward accumulates onto the summed .grad
        (want ** 2).sum().backward(retain_graph=i == 0)
        (got ** 2).sum().backward(retain_graph=i == 0)
    if pending != [2, 2]:  # the final norm's, then the block's
        problems.append(f"sums pending at block.norm's gradient: {pending}, not [2, 2]")
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if _rel(p.grad.full_tensor(), grads[name].grad) > TOL["f32"]:
            problems.append(f"grad {name} rel {_rel(p.grad.full_tensor(), grads[name].grad):.1e}")
    return problems


def _save(mesh, path: str) -> dict[str, torch.Tensor]:
    """One AdamW step of the sharded Llama, saved with torch.distributed.checkpoint; returns
    the full (unsharded) weights it saved, from every rank."""
    import torch.distributed.checkpoint as dcp
    import commfuse.tp as tp
    ids, labels = _batches(1)
    model = tp.parallelize(build("llama"), mesh, method="commfuse")
    _train(model, None, ids, labels, 1)
    dcp.save(model.state_dict(), checkpoint_id=path)
    # as numpy: tensors would cross the result queue as shared memory that dies with the rank
    return {n: p.full_tensor().numpy() for n, p in model.state_dict().items()}


def _run(rank: int, world: int, path: str) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {"saved": _save(mesh, path) if world == 2 else None}
    for arch, method, attn, seq in EXACT:
        out[f"exact-{arch}-{method}-{attn}-seq{seq}"] = _check_exact(arch, method, attn, seq, mesh)
    for method in ("none", "commfuse"):
        out[f"styles-{method}"] = _check_styles(mesh, method)
    for arch, method in TRAIN if world == 2 else ():
        out[f"train-{arch}-{method}"] = _check_train(arch, method, mesh)
    if world == 4:
        for method in ("commfuse", "none"):
            out[f"fsdp2-{method}"] = _check_fsdp(method)
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, _checkpoint_dir(), timeout=600, pg_timeout_s=60)


@functools.lru_cache(maxsize=None)
def _checkpoint_dir() -> str:
    import atexit
    import shutil
    import tempfile
    path = tempfile.mkdtemp(prefix="commfuse-tp-dcp-")
    atexit.register(shutil.rmtree, path, True)
    return path


CASES = [(w, f"exact-{a}-{m}-{at}-seq{s}") for w in (2, 4) for a, m, at, s in EXACT]
CASES += [(w, f"styles-{m}") for w in (2, 4) for m in ("none", "commfuse")]
CASES += [(2, f"train-{a}-{m}") for a, m in TRAIN]
CASES += [(4, f"fsdp2-{m}") for m in ("commfuse", "none")]


@pytest.mark.parametrize("world,case", CASES, ids=[f"{w}-{c}" for w, c in CASES])
def test_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


def test_checkpoint_of_dtensor_params_loads_unsharded():
    """The TP-sharded DTensors saved on 2 ranks load into the plain model in one process
    (DCP reshards by their placements)."""
    import torch.distributed.checkpoint as dcp
    saved = results(2)[0]["saved"]
    model = build("llama", seed=1)  # other weights, overwritten by the load
    state = model.state_dict()
    dcp.load(state, checkpoint_id=_checkpoint_dir())
    assert set(state) == set(saved)
    for name, t in state.items():
        assert torch.equal(t, torch.from_numpy(saved[name])), name


# --- no processes: what parallelize refuses ------------------------------------------------

@pytest.mark.parametrize("arch,cfg,T,match", [
    ("llama", {"num_attention_heads": 4}, 3, r"num_attention_heads \(4\) must be divisible"),
    ("llama", {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 48}, 4,
     r"num_key_value_heads \(3\) and the TP size \(4\)"),
    ("llama", {"vocab_size": 3}, 4, r"vocab size \(3\) is below the TP size"),
])
def test_plan_rejects(arch, cfg, T, match):
    import transformers
    from commfuse.tp.plan import derive_plan
    c = transformers.LlamaConfig(**{**CFG, **cfg})
    with pytest.raises(ValueError, match=match):
        derive_plan(transformers.LlamaForCausalLM(c), T)


def test_plan_replicates_kv_heads_when_fewer_than_ranks():
    from commfuse.tp.plan import derive_plan
    for T, k in ((2, 1), (4, 2)):
        styles = derive_plan(build("llama"), T).styles
        assert styles["model.layers.0.self_attn.k_proj"].replicas == k


@pytest.mark.parametrize("kw,err,match", [
    (dict(method="fast"), ValueError, "method must be one of"),
    (dict(method="none", topology="ring"), ValueError, "unknown option"),
    (dict(replicas=0), ValueError, "replicas must be a positive int"),
])
def test_styles_reject_bad_options(kw, err, match):
    from commfuse.tp import FusedColwiseParallel
    with pytest.raises(err, match=match):
        FusedColwiseParallel(**kw)

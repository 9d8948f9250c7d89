"""One transformers model (a Llama, a Gemma 3, a Qwen3.5, a DeepSeek-V3 stack, or a hybrid
Mamba-2 model: Nemotron-H, Bamba), several tensor-parallel plans, one run: commfuse TP under
several methods, DTensor's own TP (Llama), transformers' own ``tp_plan="auto"``, and
commfuse's styles with method="none" (the collective, then the GEMM).

    commfuse launch --nproc 2 --link 1gbit -- python scripts/bench_tp_hf.py --json out/tp_hf.json
    commfuse launch --nproc 2 --link 1gbit -- python scripts/bench_tp_hf.py --model nemotron-h \
        --method commfuse --variants auto,commfuse,sliced,none --json out/hybrid.json
    python scripts/bench_tp_hf.py --local 2 --hidden 64 --layers 2 --seq 64 --steps 3   # loopback

``--model nemotron-h``: NemotronHForCausalLM whose layers are ``--pattern`` (M a Mamba-2 mixer,
- a squared-ReLU MLP of ``--ffn``, * attention, E an MoE layer of ``--experts`` squared-ReLU
experts of ``--expert-ffn``, ``--top-k`` per token, and a shared expert of ``--ffn``, its
experts split over the ranks; Nemotron-H's notation); ``--model bamba``:
BambaForCausalLM, M / * a Mamba-2 or attention layer, each with a SwiGLU MLP. The Mamba-2
mixers have ``--mamba-heads`` of ``--mamba-head-dim``, ``--mamba-groups`` B/C groups of
``--state``, scan chunk ``--chunk`` (transformers' torch path on CPU).

Variants (``--variants``): ``commfuse`` = `commfuse.tp.parallelize(method=--method)`;
``auto``, ``sliced``, ``decompose`` = the same plan with that method;
``commfuse-keep`` = ``commfuse`` with ``save_gathered=True`` (the gathered inputs kept for
backward, as DTensor keeps them: the same activation memory as ``dtensor``);
``none`` = the plan of ``commfuse`` with method="none"; ``compute-only`` = ``none``'s model
run in `commfuse.runtime.modes` ``compute_only`` mode: every transfer of the fused ops, the
plan's own gathers, reduce-scatters and gradient sums and the vocabulary-parallel loss's
collectives replaced by stand-ins that move nothing and keep the shapes (the MoE layers' count
and routing exchanges, a few bytes per row that fix the dispatched shapes, still move), so
``compute-only / none`` is the step with no communication at all: the lower bound of any
overlap method on this model (its losses are not the others': what it "receives" is not the
peers' data); ``dtensor`` = torch's ColwiseParallel /
RowwiseParallel / SequenceParallel / PrepareModuleInput plan (torchtitan's, on HF's module
names; ``transformers`` = the model loaded with transformers' ``tp_plan="auto"`` (its config's
``base_model_tp_plan`` in DTensor: no sequence parallelism, outputs it does not split gathered;
it needs accelerate, the ``bench`` extra);
``dtensor``: Llama only: transformers' tp_plans for Nemotron-H and Bamba cover their attention (and
Bamba's MLP) layers, not the Mamba-2 mixers, so there is no DTensor plan for the whole model). Every variant starts from the same weights and trains on the same batches with AdamW;
their steps are interleaved, the order rotating every step, after ``--warmup`` untimed steps,
with a barrier before each. A step's time is the slowest rank's (fwd + bwd + optimizer). Rank 0
prints per variant the median step and its 10-90 % spread, tokens/s, the ratio to ``none``
and the losses, and writes them with the config to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def build(a):
    if a.model == "gemma3":
        return build_gemma3(a)
    if a.model in ("qwen3.5", "deepseek-v3"):
        return build_new(a)
    if a.model != "llama":
        return build_hybrid(a)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, max_position_embeddings=max(a.seq, 64),
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(a.seed)
    return LlamaForCausalLM(cfg)


def build_gemma3(a):
    """Gemma 3 (text) of ``a``'s sizes: tied embeddings, ``--window`` sliding-window layers with
    every sixth global, as Gemma 3 lays them out."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(a.layers)]
    cfg = Gemma3TextConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                           num_hidden_layers=a.layers, num_attention_heads=a.heads,
                           num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                           max_position_embeddings=max(a.seq, 64), sliding_window=a.window,
                           layer_types=kinds, tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(a.seed)
    return Gemma3ForCausalLM._from_config(cfg, attn_implementation="sdpa")


def build_new(a):
    """Qwen3.5 (``--pattern`` L a Gated DeltaNet layer, * gated attention; every layer a SwiGLU
    MLP of ``--ffn``) or a DeepSeek-V3 stack (multi-head latent attention; ``--pattern`` D a
    dense SwiGLU MLP of ``--ffn``, E an MoE layer of ``--experts`` of ``--expert-ffn``,
    ``--top-k``, one shared expert)."""
    import transformers
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                  num_hidden_layers=len(a.pattern), num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, max_position_embeddings=max(a.seq, 64),
                  tie_word_embeddings=False, use_cache=False)
    if a.model == "qwen3.5":
        kinds = {"L": "linear_attention", "*": "full_attention"}
        cfg = transformers.Qwen3_5TextConfig(
            **common, head_dim=a.hidden // a.heads, layer_types=[kinds[c] for c in a.pattern],
            linear_num_key_heads=a.linear_key_heads, linear_num_value_heads=a.linear_value_heads,
            linear_key_head_dim=a.linear_head_dim, linear_value_head_dim=a.linear_head_dim)
        cls = transformers.Qwen3_5ForCausalLM
    else:
        if a.pattern.lstrip("D") != "E" * len(a.pattern.lstrip("D")):
            raise ValueError("deepseek-v3: --pattern is dense layers (D) then MoE layers (E)")
        head = a.hidden // a.heads
        cfg = transformers.DeepseekV3Config(
            **common, first_k_dense_replace=len(a.pattern) - len(a.pattern.lstrip("D")),
            n_routed_experts=a.experts, num_experts_per_tok=a.top_k, n_shared_experts=1,
            moe_intermediate_size=a.expert_ffn, n_group=1, topk_group=1,
            q_lora_rank=3 * a.hidden // 8, kv_lora_rank=a.hidden // 4,
            qk_rope_head_dim=head // 4, qk_nope_head_dim=head - head // 4, v_head_dim=head,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(a.seed)
    return cls._from_config(cfg, attn_implementation="sdpa")


def build_hybrid(a):
    """Nemotron-H or Bamba of ``--pattern`` with the Mamba-2 and attention sizes of ``a``."""
    import transformers
    mamba = dict(num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 intermediate_size=a.ffn, vocab_size=a.vocab, hidden_size=a.hidden,
                 max_position_embeddings=max(a.seq, 64), tie_word_embeddings=False,
                 use_cache=False)
    if a.model == "nemotron-h":
        kinds = {"M": "linear_attention", "-": "mlp", "*": "full_attention", "E": "moe"}
        moe = dict(n_routed_experts=a.experts, num_experts_per_tok=a.top_k,
                   moe_intermediate_size=a.expert_ffn, moe_shared_expert_intermediate_size=a.ffn,
                   n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
        cfg = transformers.NemotronHConfig(
            **(moe if "E" in a.pattern else {}),
            layers_block_type=[kinds[c] for c in a.pattern], head_dim=a.hidden // a.heads,
            mamba_num_heads=a.mamba_heads, mamba_head_dim=a.mamba_head_dim,
            n_groups=a.mamba_groups, ssm_state_size=a.state, chunk_size=a.chunk, **mamba)
    else:
        cfg = transformers.BambaConfig(
            num_hidden_layers=len(a.pattern),
            attn_layer_indices=[i for i, c in enumerate(a.pattern) if c == "*"],
            mamba_n_heads=a.mamba_heads, mamba_d_head=a.mamba_head_dim,
            mamba_expand=a.mamba_heads * a.mamba_head_dim // a.hidden,
            mamba_n_groups=a.mamba_groups, mamba_d_state=a.state, mamba_chunk_size=a.chunk,
            **mamba)
    torch.manual_seed(a.seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def dtensor_tp(model, mesh):
    """torch's own TPSP plan (torchtitan's Llama plan on HF's module names)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    T, cfg = mesh.size(), model.config
    if cfg.num_key_value_heads % T:
        raise ValueError("the dtensor plan needs num_key_value_heads divisible by the TP size")
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1), use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            p + "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    parallelize_module(model, mesh, plan)
    return model


VARIANTS = ("commfuse", "commfuse-keep", "dtensor", "transformers", "none", "auto", "sliced",
            "decompose", "compute-only")


def transformers_tp(model, mesh):
    """The model under transformers' own tensor parallelism: its ``tp_plan="auto"`` (the
    config's ``base_model_tp_plan``, DTensor), loaded from a copy of the same weights that
    rank 0 writes to a temporary directory."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM
    path = [tempfile.mkdtemp(prefix="bench_tp_hf_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    if dist.get_rank() == 0:
        model.save_pretrained(path[0])
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(path[0], tp_plan="auto", device_mesh=mesh,
                                                  dtype=torch.float32)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0])
    return loaded


def make(variant: str, a, mesh):
    import commfuse.tp
    model = build(a)
    if variant == "dtensor":
        return dtensor_tp(model, mesh)
    if variant == "transformers":
        return transformers_tp(model, mesh)
    method = variant if variant in ("none", "auto", "sliced", "decompose") else a.method
    method = "none" if variant == "compute-only" else method
    return commfuse.tp.parallelize(model, mesh, method=method,
                                   save_gathered=variant == "commfuse-keep",
                                   loss_parallel=a.loss_parallel, defer_grad_sums=True)


def run(rank: int, world: int, a) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(a.threads)
    mesh = init_device_mesh("cpu", (world,))
    from commfuse.ops.auto import use_hardware
    from commfuse.runtime import modes
    _, line = use_hardware(a.hardware, torch.zeros(()), mesh.get_group())  # auto's and m's model
    if rank == 0:
        print(line, flush=True)
    g = torch.Generator().manual_seed(a.seed + 1)
    batches = torch.randint(a.vocab, (4, a.batch, a.seq), generator=g)
    runs = {}
    for v in a.variants:
        model = make(v, a, mesh)
        runs[v] = dict(model=model, opt=torch.optim.AdamW(model.parameters(), lr=a.lr),
                       times=[], losses=[],
                       mode="compute_only" if v == "compute-only" else "normal")
    for step in range(a.warmup + a.steps):
        order = a.variants[step % len(a.variants):] + a.variants[:step % len(a.variants)]
        ids = batches[step % len(batches)]
        for v in order:
            r = runs[v]
            dist.barrier()
            t0 = time.perf_counter()
            with modes.mode(r["mode"]):
                loss = r["model"](ids, labels=ids).loss
                loss.backward()
                r["opt"].step()
                r["opt"].zero_grad()
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= a.warmup:
                r["times"].append(dt.item())
                r["losses"].append(loss.item())
    if rank:
        return None
    return report(a, world, {v: {k: r[k] for k in ("times", "losses")} for v, r in runs.items()})


def report(a, world: int, runs: dict) -> dict:
    out = {"config": {k: v for k, v in vars(a).items() if k != "json"}, "world": world,
           "variants": {}}
    tokens = a.batch * a.seq
    base = statistics.median(runs["none"]["times"]) if "none" in runs else None
    print(f"{describe(a)}; batch {a.batch} x seq {a.seq}; TP {world}; "
          f"{a.steps} timed steps after {a.warmup}")
    print(f"{'variant':13} {'step ms':>9} {'p10-p90 ms':>15} {'tokens/s':>10} {'vs none':>8}  losses")
    for v, r in runs.items():
        ts = sorted(r["times"])
        med = statistics.median(ts)
        p10, p90 = ts[int(0.1 * (len(ts) - 1))], ts[int(0.9 * (len(ts) - 1))]
        ratio = med / base if base else None
        out["variants"][v] = dict(median_s=med, p10_s=p10, p90_s=p90, tokens_per_s=tokens / med,
                                  vs_none=ratio, losses=r["losses"], times_s=r["times"])
        print(f"{v:13} {med * 1e3:9.1f} {p10 * 1e3:7.1f}-{p90 * 1e3:<7.1f} {tokens / med:10.0f} "
              f"{'' if ratio is None else f'{ratio:8.3f}'}  "
              + " ".join(f"{x:.4f}" for x in r["losses"]))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    return out


def describe(a) -> str:
    """The model in one line."""
    attn = f"{a.heads}/{a.kv_heads} heads, ffn {a.ffn}, vocab {a.vocab}"
    if a.model == "llama":
        return f"Llama hidden {a.hidden}, {a.layers} layers, {attn}"
    if a.model == "gemma3":
        return (f"Gemma 3 hidden {a.hidden}, {a.layers} layers (5 of 6 with a window of "
                f"{a.window}), {attn}, tied embeddings")
    if a.model == "qwen3.5":
        return (f"Qwen3.5 hidden {a.hidden}, layers {a.pattern} (L Gated DeltaNet: "
                f"{a.linear_key_heads} key / {a.linear_value_heads} value heads of "
                f"{a.linear_head_dim}; * gated attention {attn})")
    if a.model == "deepseek-v3":
        return (f"DeepSeek-V3 hidden {a.hidden}, layers {a.pattern} (MLA {a.heads} heads; D "
                f"dense MLP {a.ffn}; E {a.experts} experts of {a.expert_ffn}, top-{a.top_k}, "
                f"1 shared), vocab {a.vocab}")
    return (f"{a.model} hidden {a.hidden}, layers {a.pattern}, Mamba-2 {a.mamba_heads} heads x "
            f"{a.mamba_head_dim}, {a.mamba_groups} groups x state {a.state}, chunk {a.chunk}; "
            f"attention {attn}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default="llama", choices=("llama", "gemma3", "nemotron-h", "bamba", "qwen3.5",
                                              "deepseek-v3"))
    add("--linear-key-heads", type=int, default=8, help="qwen3.5: Gated DeltaNet key heads")
    add("--linear-value-heads", type=int, default=16, help="qwen3.5: its value heads")
    add("--linear-head-dim", type=int, default=64, help="qwen3.5: its key and value head dim")
    add("--window", type=int, default=512, help="gemma3: the sliding window of its local layers")
    add("--pattern", default=None,
        help="hybrid layers: M Mamba-2, - MLP, E MoE (nemotron-h), * attention (default: M-M-M*-M- "
             "for nemotron-h, Nemotron-H's mix of 4 Mamba-2, 4 MLP, 1 attention; MMM* for bamba)")
    add("--mamba-heads", type=int, default=16)
    add("--mamba-head-dim", type=int, default=64)
    add("--mamba-groups", type=int, default=2)
    add("--state", type=int, default=64, help="SSM state size")
    add("--chunk", type=int, default=128, help="the scan's chunk")
    add("--hidden", type=int, default=512)
    add("--layers", type=int, default=8)
    add("--heads", type=int, default=8)
    add("--kv-heads", type=int, default=4)
    add("--ffn", type=int, default=1376, help="the MLPs' width (and an MoE layer's shared "
        "expert's)")
    add("--experts", type=int, default=8, help="routed experts of an MoE layer (E)")
    add("--top-k", type=int, default=2, help="experts per token of an MoE layer")
    add("--expert-ffn", type=int, default=688, help="a routed expert's width")
    add("--vocab", type=int, default=4096)
    add("--seq", type=int, default=1024, help="tokens per sequence")
    add("--batch", type=int, default=4, help="sequences per step (every rank: the same)")
    add("--steps", type=int, default=10, help="timed steps per variant")
    add("--warmup", type=int, default=3, help="untimed steps per variant first")
    add("--lr", type=float, default=1e-3)
    add("--seed", type=int, default=0)
    add("--method", default="auto", help="the commfuse variant's method")
    add("--variants", default="commfuse,dtensor,none",
        type=lambda s: [v for v in s.split(",") if v])
    add("--loss-parallel", action="store_true",
        help="commfuse variants and none: the head's logits stay vocabulary-sharded and the "
             "loss is vocabulary-parallel (commfuse.tp.parallelize(loss_parallel=True)); "
             "not with dtensor")
    add("--threads", type=int, default=1, help="intra-op threads per rank")
    from commfuse.ops.auto import add_hardware_flag
    add_hardware_flag(p)
    add("--json", default=None, metavar="FILE", help="rank 0 writes the results here")
    add("--local", type=int, default=0, metavar="N",
        help="spawn N local ranks (loopback) instead of reading torchrun's environment")
    a = p.parse_args(argv)
    bad = set(a.variants) - set(VARIANTS)
    if bad or not a.variants:
        p.error(f"unknown variant(s) {sorted(bad)}: choose from {', '.join(VARIANTS)}")
    if a.loss_parallel and "dtensor" in a.variants:
        p.error("--loss-parallel is not built for the dtensor variant (torch's loss_parallel "
                "needs DTensor logits): leave dtensor out or drop --loss-parallel")
    if "transformers" in a.variants and a.loss_parallel:
        p.error("--loss-parallel is commfuse's: leave the transformers variant out or drop it")
    if a.model != "llama" and "dtensor" in a.variants:
        p.error(f"no dtensor variant for {a.model}: the dtensor plan here is Llama's (and "
                f"transformers' tp_plans do not cover Mamba-2 mixers)")
    allowed = {"nemotron-h": "M-*E", "qwen3.5": "L*", "deepseek-v3": "DE"}.get(a.model, "M*")
    a.pattern = a.pattern or {"nemotron-h": "M-M-M*-M-", "qwen3.5": "LLL*",
                              "deepseek-v3": "DEEE"}.get(a.model, "MMM*")
    if a.model == "bamba" and a.mamba_heads * a.mamba_head_dim % a.hidden:
        p.error("bamba: --mamba-heads x --mamba-head-dim must be a multiple of --hidden "
                "(its mixer's width is an integer expand x hidden)")
    if a.model in ("nemotron-h", "bamba", "qwen3.5", "deepseek-v3") and (
            not a.pattern or set(a.pattern) - set(allowed)):
        p.error(f"--pattern for {a.model} takes the characters {allowed!r}, got {a.pattern!r}")
    return a


def start(fn, a, *args) -> None:
    """``fn(rank, world, a, *args)`` on every rank: ``--local`` ranks spawned here, else this
    process as torchrun's (or `commfuse launch`'s) rank."""
    if a.local:
        from commfuse.testbed.spawn import run_local
        run_local(fn, a.local, a, *args, timeout=3600, threads=a.threads)
        return
    from commfuse.runtime.gloo import duplex
    dist.init_process_group("gloo")
    duplex()
    try:
        fn(dist.get_rank(), dist.get_world_size(), a, *args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    start(run, parse(argv))


if __name__ == "__main__":
    main()

"""Every causal-LM model type of the installed transformers under `commfuse.tp.parallelize`:
each type's tiny model (float32) on 2 ranks (gloo) against the unsharded model, methods
``none`` and ``commfuse``: logits, loss and every parameter's gradient (norm-relative,
``TOL``). Rerun it after upgrading transformers.

    nice -n 10 python scripts/family_sweep.py [--types a,b] [--out docs/support-sweep.csv]
                                              [--timeout 300]

Each type ends as one of
    exact     every tensor within TOL under both methods
    refused   `derive_plan` raised its ValueError before any weight moved (the reason)
    MISMATCH  a tensor off by more than TOL (the worst: method, tensor, relative error)
    error     an exception, a timeout or a killed process (its last line)
    skipped   not a text-only LM, or its unsharded forward needs more than input_ids/labels
Types run one after another in a worker process (its ranks forked fresh per type) under
``--timeout`` each; a hang or an out-of-memory kill ends that type only (the worker is
started again). The CSV's rows of the types run replace theirs in ``--out``, the others are
kept (so batches add up); ``python -m commfuse.tp.families --write`` puts the result in
docs/support.md.

The tiny config: the model class's own config with every field of `SMALL` that it has set
to the small value (heads, kv heads and experts divide 2), its per-layer lists cut to one
layer of each kind, token ids past the vocabulary set to 0, dropout 0, plus `OVERRIDES` per
type. Parameters left at zero by the model's initialisation are drawn (as the tests do).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

TOL = 1e-5  # norm-relative, as tests/test_tp_families.py
METHODS = ("none", "commfuse")
SMALL = dict(  # field -> small value, where the config has the field (see OFF_WHEN_NONE)
    vocab_size=63, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_heads=8,
    max_position_embeddings=64, sliding_window=4, attention_chunk_size=4, rotary_dim=4,
    # encoder-decoder and older configs' names
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_layers=2, decoder_layers=2,
    encoder_ffn_dim=40, decoder_ffn_dim=40,
    # sparse MoE: top 2 of 4 experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_k=2, moe_topk=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1,
    first_k_dense_replace=1,
    # multi-head latent attention
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
    # Gated DeltaNet: 2 key heads over 4 value heads
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4,
    # Mamba-2: 8 SSM heads of 8 over 2 groups of state 8, chunks of 4
    n_groups=2, state_size=8, ssm_state_size=8, chunk_size=4, conv_kernel=4, expand=2,
    mamba_n_heads=8, mamba_num_heads=8, mamba_d_head=8, mamba_head_dim=8, mamba_n_groups=2,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4, mamba_d_ssm=64)
# fields whose None turns a feature off (left None); other None defaults get the small value
OFF_WHEN_NONE = ("sliding_window", "attention_chunk_size", "q_lora_rank")
OVERRIDES: dict[str, dict] = {  # model_type -> fields the generic shrink gets wrong
    # hybrids whose layer kinds are not one per-layer list: one layer of each kind
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "zamba": {"num_hidden_layers": 3,  # its shared block in two layers
              "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "kolibri1_1": {"num_hidden_layers": 2, "head_dim": 16, "layer_types": ["sliding_attention",
                                                           "indexed_attention"],
                   "kv_source_layers": [0, 1], "index_layers": [1], "mlp_only_layers": [0],
                   "index_num_heads": 2, "index_topk": 4, "index_pool_size": 16,
                   "index_compression": 2, "index_num_local_tokens": 2,
                   "index_num_sink_tokens": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": 63,
                     "hidden_size_per_layer_input": 8},
    "dots3_note": {"num_key_value_heads": 4},
    "dots3_note_text": {"num_key_value_heads": 4},
    "zaya": {"num_experts_per_tok": 1},
    "big_bird": {"attention_type": "original_full"},
    "xlnet": {"d_head": 8},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16]},
    # defaults that leave out what every checkpoint sets
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
             "ffn_config": {"ffn_hidden_size": 40, "moe_num_experts": 4, "moe_top_k": 2}},
    "cohere_compass_text": {"logit_scale": 0.5, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
        "indexer_compress_ratio": 4}),
}
TEXT_PARTS = ("attn_config", "ffn_config")  # sub-configs of a text-only LM (DBRX, MPT)
# Gated DeltaNet's decay rates drawn small (see commfuse.tp.families.SMALL_DECAY)
REDRAW = {"A_log": (-4.6, 0.0)}


def model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _layers_kept(values: list, default_layers: int) -> list[int]:
    """The layer indices kept: the first of each kind (``values``: each layer's, a tuple of
    its per-layer fields), at least 2 layers."""
    first = sorted({v: i for i, v in reversed(list(enumerate(values)))}.values())
    return first if len(first) >= 2 else list(range(min(2, default_layers)))


def tiny_config(model_type: str):
    """``model_type``'s tiny config (the module docstring says how it is made)."""
    cls = model_class(model_type).config_class
    base = cls()
    have = {**base.to_dict(), **dict.fromkeys(getattr(cls, "attribute_map", {}))}
    over = {k: v for k, v in SMALL.items()
            if k in have and (have[k] is not None or k not in OFF_WHEN_NONE)}
    if "qk_rope_head_dim" in have:  # latent attention: head_dim the rotary part, kv heads H
        over.update(head_dim=SMALL["qk_rope_head_dim"],
                    num_key_value_heads=SMALL["num_attention_heads"])
    L = getattr(base, "num_hidden_layers", None)
    per_layer = {k: v for k, v in base.to_dict().items()
                 if isinstance(v, (list, str)) and L and len(v) == L > 2 and k != "model_type"}
    if per_layer:
        keep = _layers_kept(list(zip(*per_layer.values())), L)
        for k, v in per_layer.items():
            kept = [v[i] for i in keep]
            over[k] = "".join(kept) if isinstance(v, str) else kept
        over["num_hidden_layers"] = len(keep)
    for k, v in base.to_dict().items():
        if k.endswith(("token_id", "token_index")) and isinstance(v, int) and v >= 63:
            over[k] = 0
        elif ("dropout" in k or "pdrop" in k) and isinstance(v, float):
            over[k] = 0.0  # the two models' dropout masks would differ
    return cls(**{**over, **OVERRIDES.get(model_type, {})})


def build(model_type: str, seed: int = 0):
    """``model_type``'s tiny model in float32, its weights drawn from ``seed``."""
    import torch

    from commfuse.tp.families import exercise
    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    return exercise(model_class(model_type)(cfg).float(), REDRAW)


def _batch():
    import torch
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 63, (2, 11), generator=g)  # 11 tokens: uneven shards
    labels = ids.clone()
    labels[0, 2] = -100
    return ids, labels


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _errors(model_type: str, method: str, mesh) -> list[tuple[float, str]]:
    """(relative error, tensor) of the logits, the loss and every gradient of
    ``model_type`` sharded by ``method`` against the unsharded model."""
    import commfuse.tp as tp
    from commfuse.tp.attention import unpack_rows
    ref = build(model_type)
    model = copy.deepcopy(ref)
    ids, labels = _batch()
    out = ref(ids, labels=labels)
    out.loss.backward()
    tp.parallelize(model, mesh, method=method)
    got = model(ids, labels=labels)
    got.loss.backward()
    errs = [(_rel(got.logits.detach(), out.logits.detach()), "logits"),
            (_rel(got.loss.detach(), out.loss.detach()), "loss")]
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        mod = model.get_submodule(name.rpartition(".")[0])
        style = next((getattr(mod, a) for a in ("_commfuse_colwise", "_commfuse_split_norm",
                                                "_commfuse_rows") if hasattr(mod, a)), None)
        if p.grad is None or want[name].grad is None:
            if (p.grad is None) != (want[name].grad is None):
                errs.append((float("inf"), f"grad {name} (one side has none)"))
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        g = g if style is None else unpack_rows(style, g, mesh.size())
        errs.append((_rel(g, want[name].grad), f"grad {name}"))
    return errs


def _rank(rank: int, world: int, model_type: str) -> dict[str, tuple[float, str]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    return {m: max(_errors(model_type, m, mesh)) for m in METHODS}


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def check(model_type: str, timeout: float) -> dict:
    """``model_type``'s outcome: ``{"status": ..., "detail": ...}``."""
    cls = model_class(model_type)
    subs = [k for k in getattr(cls.config_class, "sub_configs", {}) or {} if k not in TEXT_PARTS]
    if subs:
        return dict(status="skipped", detail=f"not a text-only LM ({cls.config_class.__name__} "
                                             f"has {', '.join(subs)})")
    try:
        model = build(model_type)
    except Exception as e:
        return dict(status="error", detail=f"building the tiny model: {_line(e)}")
    from commfuse.tp.plan import derive_plan
    try:
        derive_plan(model, 2)
    except ValueError as e:
        return dict(status="refused", detail=str(e).split(": ", 1)[-1])
    try:
        ids, labels = _batch()
        out = model(ids, labels=labels)
        if getattr(out, "loss", None) is None or getattr(out, "logits", None) is None:
            return dict(status="skipped", detail="no loss and logits from input_ids and labels")
        out.loss.backward()
    except Exception as e:
        return dict(status="skipped", detail=f"the unsharded forward on input_ids and labels "
                                             f"fails ({_line(e)})")
    from commfuse.testbed.spawn import run_local, start_ranks
    start_ranks(preload=("transformers", "commfuse.tp", cls.__module__, "family_sweep"))
    import family_sweep  # this file as a module: the ranks unpickle its _rank
    try:
        res = run_local(family_sweep._rank, 2, model_type, timeout=timeout, pg_timeout_s=60)
    except Exception as e:
        tail = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return dict(status="error", detail=f"{type(e).__name__}: {tail[-1] if tail else ''}")
    worst = max((err, m, what) for r in res for m, (err, what) in r.items())
    if worst[0] > TOL:
        return dict(status="MISMATCH", detail=f"{worst[1]}: {worst[2]} rel {worst[0]:.1e}")
    return dict(status="exact", detail=f"max rel {worst[0]:.0e}")


class Worker:
    """A ``--worker`` process (a process group of its own) that checks the types it is sent,
    one at a time, so torch and transformers are imported once, not per type; killed and
    started again after a type that times out or kills it."""

    def __init__(self, timeout: float):
        self.timeout, self.proc = timeout, None

    def check(self, model_type: str) -> dict:
        if self.proc is None:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker",
                   "--timeout", str(self.timeout)]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, start_new_session=True)
            self.lines = queue.Queue()
            threading.Thread(target=self._read, args=(self.proc, self.lines),
                             daemon=True).start()
        self.proc.stdin.write(model_type + "\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=self.timeout + 60)
        except queue.Empty:
            self.close()
            return dict(status="error", detail=f"timed out after {self.timeout + 60:.0f} s")
        if line is None:  # the worker died (out of memory, a crash)
            code = self.proc.wait()
            self.close()
            return dict(status="error", detail=f"the process died (exit code {code})")
        return json.loads(line)

    @staticmethod
    def _read(proc, lines) -> None:
        for line in proc.stdout:
            if line.startswith("RESULT "):
                lines.put(line[len("RESULT "):])
        lines.put(None)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None


def _serve(timeout: float) -> None:
    """``--worker``: a type per line of stdin, its result as one ``RESULT`` line."""
    for line in sys.stdin:
        try:
            res = check(line.strip(), timeout)
        except Exception as e:
            res = dict(status="error", detail=_line(e))
        print("RESULT " + json.dumps(res), flush=True)


FIELDS = ("model_type", "status", "detail", "transformers")


def read(path: str) -> dict[str, dict]:
    """The sweep CSV at ``path``: model_type -> row."""
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        return {r["model_type"]: r for r in csv.DictReader(f)}


def write(path: str, rows: dict[str, dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, lineterminator="\n")
        w.writeheader()
        for t in sorted(rows):
            w.writerow({k: rows[t][k] for k in FIELDS})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", help="comma-separated model types (default: every causal LM)")
    ap.add_argument("--out", default="docs/support-sweep.csv", help="the CSV (rows merged)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per type")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _serve(args.timeout)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows, worker = read(args.out), Worker(args.timeout)
    for i, t in enumerate(types, 1):
        start = time.monotonic()
        res = worker.check(t)
        res["detail"] = " ".join(res["detail"].split())[:300]
        rows[t] = dict(model_type=t, transformers=transformers.__version__, **res)
        write(args.out, rows)
        print(f"[{i}/{len(types)}] {t}: {res['status']} ({time.monotonic() - start:.0f} s) "
              f"{res['detail'][:160]}", flush=True)
    worker.close()
    counts = {}
    for t in types:
        counts[rows[t]["status"]] = counts.get(rows[t]["status"], 0) + 1
    print(", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the ranks import this file
    main()

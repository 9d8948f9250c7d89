"""``commfuse generate --bench``: every method's prefill latency, time to first token and
decode tokens/s on the same prompts, rounds interleaved, beside the simulator's prediction
(`commfuse.infer.predict`). Its rows are `BENCH`; the command's doc is `commfuse.infer.cli`'s.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from commfuse.infer import plans
from commfuse.infer.loop import Sampling, Timings, generate
from commfuse.runtime import modes

METHODS = ("none", "sliced", "decompose", "commfuse", "auto")
# --bench rows: (label, prefill method, decode method, executor mode, prefill chunks: "auto"
# --prefill-chunks or auto's own choice, `commfuse.infer.plans`; None --prefill-chunks or the
# model's best count, `predict.best_chunks`); "allreduce" prefills as none; "compute alone" is
# none with every transfer skipped (commfuse.runtime.modes)
BENCH = ([(m, m, m, "normal", "auto" if m == "auto" else 1) for m in METHODS]
         + [("interleaved", "none", "none", "normal", None),
            ("allreduce", "none", "allreduce", "normal", 1),
            ("compute alone", "none", "none", "compute_only", 1)])


def predict(model, world: int, method: str, decode: str, S: int, context: int,
            batch: int) -> dict:
    """The simulator's prefill ms and decode tokens/s (`commfuse.infer.predict`) on the
    hardware model ``auto`` uses (`commfuse.ops.auto.set_hardware`; cpu-testbed on CPU), and
    the decode method that ran ("decode_ran": decode "auto" runs allreduce's step or the
    fused ops', `commfuse.infer.predict.decode_choice`), whose step the prediction times."""
    from commfuse.infer.predict import decode_s, interleaved_prefill_s, prefill_s
    from commfuse.ops.auto import _hardware

    w = model.tok_emb.weight
    hw, nbytes = _hardware(w.device.type), w.element_size()
    decode = plans.decode_method(model, batch, w, decode)  # the step that ran (auto resolved)
    if method == "compute alone":
        return {"sim_prefill_ms": float("nan"), "sim_decode_tokens_per_s": float("nan"),
                "decode_ran": decode}
    chunks = min(plans.runs_chunks(model, method, S, batch, w), S)
    if chunks > 1:
        prefill = interleaved_prefill_s(model.cfg, world, S, chunks, hw, nbytes, batch)
    else:
        prefill = prefill_s(model.cfg, world, method, S, hw, nbytes, batch=batch,
                            query_split=model.runs_query_split(method, S, batch, w))
    return {"decode_ran": decode, "prefill_chunks": chunks,
            "sim_prefill_ms": prefill * 1e3,
            "sim_decode_tokens_per_s":
                1 / decode_s(model.cfg, world, decode, batch, context, hw, nbytes)}


def bench(model, prompts, args, how: Sampling, rank: int, world: int, hardware: dict) -> int:
    """Every method, interleaved, after a warm-up; rank 0 prints a table (and --json, with
    ``hardware``: the cost model's)."""
    from commfuse.infer.predict import best_chunks
    from commfuse.ops.auto import _hardware

    torch.set_flush_denormal(True)  # compute_only buffers hold garbage; keep it off slow paths
    rows = []
    chosen = model.prefill_chunks  # --prefill-chunks, or None

    def chunks(row, S: int, batch: int):  # the row's prefill chunks (see BENCH)
        if row == "auto" or (row is None and (chosen or 1) > 1):
            return chosen
        if row is not None:
            return row
        w = model.tok_emb.weight
        return best_chunks(model.cfg, world, S, batch, _hardware(w.device.type),
                           w.element_size())[0]

    for batch in prompts:
        S = max(len(p) for p in batch)
        times: dict[str, list[Timings]] = {v[0]: [] for v in BENCH}
        tuning: list[float] = []  # auto's round 0: the warm-up, then PlanTuner's timed plans
        for it in range(args.iters + 1):  # round 0 warms up, and auto tunes to the end
            for label, prefill, decode, how_run, n in BENCH:
                model.method, model.decode_method = prefill, decode
                model.prefill_chunks = chunks(n, S, len(batch))
                while True:
                    t = Timings()
                    with modes.mode(how_run):
                        generate(model, batch, args.max_new_tokens, how, None, t)
                    if it or label != "auto":
                        break
                    tuning.append(round(t.prefill_s * 1e3, 1))
                    if not plans.tuning(model, S, len(batch)) or len(tuning) > 8:
                        break
                if it:
                    times[label].append(t)
        med = {m: {"prefill_ms": statistics.median(t.prefill_s for t in ts) * 1e3,
                   "prefill_ms_rounds": [round(t.prefill_s * 1e3, 1) for t in ts],
                   "first_token_ms": statistics.median(t.first_token_s for t in ts) * 1e3,
                   "decode_tokens_per_s": statistics.median(t.decode_tokens_per_s for t in ts)}
               for m, ts in times.items()}
        for label, prefill, decode, how_run, n in BENCH:
            model.method, model.prefill_chunks = prefill, chunks(n, S, len(batch))
            sim = predict(model, world, label if how_run == "compute_only" else prefill,
                          decode, S, S + args.max_new_tokens // 2, len(batch))
            rows.append({"prompt_tokens": S, "method": label, **med[label], **sim,
                         **({"warmup_prefill_ms": tuning} if label == "auto" else {}),
                         "prefill_vs_none": med[label]["prefill_ms"] / med["none"]["prefill_ms"],
                         "decode_vs_none": med[label]["decode_tokens_per_s"]
                         / med["none"]["decode_tokens_per_s"]})
    if rank == 0:
        link = os.environ.get("COMMFUSE_LINK", "loopback" if world > 1 else "none")
        print(f"commfuse generate --bench: {model.cfg.n_layers} layers, dim {model.cfg.dim}, "
              f"tp={world}, link {link}, {args.max_new_tokens} new tokens, median of "
              f"{args.iters} rounds", flush=True)
        print(f"{'tokens':>7} {'method':<13} {'prefill ms':>10} {'x none':>7} {'sim ms':>8} "
              f"{'TTFT ms':>9} {'decode tok/s':>12} {'x none':>7} {'sim tok/s':>9}")
        for r in rows:
            print(f"{r['prompt_tokens']:>7} {r['method']:<13} {r['prefill_ms']:>10.1f} "
                  f"{r['prefill_vs_none']:>7.3f} {r['sim_prefill_ms']:>8.1f} "
                  f"{r['first_token_ms']:>9.1f} {r['decode_tokens_per_s']:>12.1f} "
                  f"{r['decode_vs_none']:>7.3f} {r['sim_decode_tokens_per_s']:>9.1f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": getattr(args, "argv", None), "world": world, "link": link,
                           **hardware, "rows": rows}, f, indent=1)
    return 0

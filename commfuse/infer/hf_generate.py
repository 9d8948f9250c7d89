"""``commfuse generate`` for the transformers families its own Llama does not model (Gemma,
Phi-3, OLMo, Mixtral, ... : `commfuse.tp.families`): the saved model sharded by
`commfuse.tp.parallelize` and run by transformers' own ``model.generate`` (prefill on the
fused sequence-sharded path, decode steps replicated, caches of this rank's heads: KV caches,
and the conv and recurrent states of Mamba-2 and Gated DeltaNet mixers).

`transformers_family` tells `commfuse.infer.cli` which models go here; `check_args`
refuses the flags of the built-in path (--query-split, --prefill-chunks, --decode-method);
`rank_main` is one rank: load, shard, generate; rank 0 prints the text. A batch of prompts
is left-padded; generation uses the cache even where the saved config turns it off (a
training run's ``use_cache: false``). ``--bench``: the model sharded once per method of
`BENCH`, rounds interleaved after a warm-up; per prompt length the prefill (a forward of the
prompt that fills the cache) and decode tokens/s (the tokens after the first new one, timed
as they arrive), each the slowest rank's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

UNSUPPORTED = ("--query-split", "--prefill-chunks", "--decode-method")
BENCH = ("none", "sliced", "commfuse", "auto")  # --bench: the methods, each its own sharding


def model_dir(args) -> Path | None:
    """The transformers model directory of ``--hf-model`` or an ``--hf-config`` checkpoint."""
    from commfuse.infer.load import checkpoint_path, is_hf_checkpoint
    if args.hf_model:
        return Path(args.hf_model)
    if args.checkpoint and is_hf_checkpoint(args.checkpoint):
        return checkpoint_path(args.checkpoint)
    return None


def transformers_family(args) -> str | None:
    """The model type of a transformers model that `commfuse.models.llama` does not model
    (read from its config.json alone); None for every other model."""
    import json

    from commfuse.models.llama import HF_TYPES
    path = model_dir(args)
    if path is None or not (path / "config.json").is_file():
        return None
    kind = json.loads((path / "config.json").read_text()).get("model_type")
    return None if kind in HF_TYPES else kind


def check_args(args, kind: str) -> None:
    """ValueError for what this path does not take, for a model of type ``kind``."""
    given = [flag for flag, on in (("--query-split", args.query_split is not None),
                                   ("--prefill-chunks", args.prefill_chunks is not None),
                                   ("--decode-method", args.decode_method is not None)) if on]
    if given:
        raise ValueError(f"{', '.join(given)}: for the built-in Llama path only; a {kind} "
                         f"model generates through transformers' generate")
    if args.prompt_tokens is not None and not args.bench:
        raise ValueError(f"--prompt-tokens is for --bench; give --prompt for a {kind} model")


def rank_main(rank: int, world: int, args) -> int:
    """One rank: the model sharded over the world, the prompts generated, rank 0 prints."""
    from transformers import AutoModelForCausalLM

    from commfuse.data import load_tokenizer
    from commfuse.infer.load import hf_tokenizer
    from commfuse.train.config import DTYPES
    path = model_dir(args)
    dtype = {"dtype": DTYPES[args.dtype]} if args.dtype else {}
    model = AutoModelForCausalLM.from_pretrained(path, **dtype)
    model.eval()
    if args.bench:
        return bench(model, args, rank, world)
    if world > 1:
        _shard(model, world, args.method, args.timeout)
    tok = hf_tokenizer(path) or load_tokenizer()
    prompts = [tok.encode(t).ids or [0] for t in args.prompt]
    longest = max(map(len, prompts))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and longest + args.max_new_tokens > limit:
        raise ValueError(f"a prompt of {longest} tokens plus {args.max_new_tokens} new ones is "
                         f"longer than the model's {limit} positions")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    sample = args.temperature > 0
    kw = dict(do_sample=sample, temperature=args.temperature, top_k=args.top_k or None,
              top_p=args.top_p) if sample else dict(do_sample=False)
    torch.manual_seed(args.seed)  # every rank samples alike
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                             pad_token_id=pad, use_cache=True, **kw)
    dt = time.perf_counter() - t0
    if rank == 0:
        for i, (p, o) in enumerate(zip(prompts, out[:, longest:].tolist())):
            head = f"[{i}] " if len(prompts) > 1 else ""
            print(f"{head}{tok.decode(p)}|{tok.decode(o)}", flush=True)
        new = out[:, longest:].numel()
        print(f"commfuse generate: {type(model).__name__} through transformers' generate, "
              f"tp={world} method={args.method}; {new} tokens in {dt:.2f} s "
              f"({new / dt:.1f} tokens/s)", file=sys.stderr, flush=True)
    return 0


def _shard(model, world: int, method: str, timeout):
    import commfuse.tp
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    return commfuse.tp.parallelize(model, mesh, method=method, timeout=timeout)


def _timed(fn, world: int) -> float:
    """Seconds of ``fn()`` on the slowest rank (the ranks start together)."""
    import torch.distributed as dist
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor(time.perf_counter() - t0)
    if world > 1:
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


class _Clock:
    """A ``generate`` streamer that notes when each token arrives (the prompt first)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, _):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def decode_tokens_per_s(self, world: int) -> float:
        """Tokens per second after the first new one, on the slowest rank."""
        import torch.distributed as dist
        dt = torch.tensor(self.times[-1] - self.times[1])
        if world > 1:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return (len(self.times) - 2) / max(dt.item(), 1e-9)


def bench(model, args, rank: int, world: int) -> int:
    """``--bench``: `BENCH`'s methods, each its own copy of ``model`` sharded with it; per
    ``--prompt-tokens`` length (prompts from the shipped corpus, batch 1) the median over
    ``--iters`` interleaved rounds, after one warm-up, of the prefill and of decode tokens/s;
    rank 0 prints a table against ``none`` (and writes ``--json``)."""
    import copy
    import json
    import statistics

    from commfuse.data import load_corpus_tokens
    if args.max_new_tokens < 3:
        raise ValueError("--bench needs --max-new-tokens of at least 3 (decode is timed from "
                         "the first new token to the last)")
    lengths = [int(n) for n in str(args.prompt_tokens or "128").split(",")]
    corpus = load_corpus_tokens()
    methods = BENCH if world > 1 else ("none",)
    models = {m: _shard(copy.deepcopy(model), world, m, args.timeout) if world > 1 else model
              for m in methods}
    rows = []
    for n in lengths:
        ids = corpus.repeat(-(-n // len(corpus)))[:n].view(1, n).long()
        gen = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                   use_cache=True)
        times = {m: ([], []) for m in methods}
        for it in range(args.iters + 1):
            for m in methods:
                clock = _Clock()
                with torch.no_grad():
                    pre = _timed(lambda: models[m](ids, use_cache=True), world)
                    models[m].generate(ids, max_new_tokens=args.max_new_tokens,
                                       min_new_tokens=args.max_new_tokens, streamer=clock, **gen)
                if it:
                    times[m][0].append(pre)
                    times[m][1].append(clock.decode_tokens_per_s(world))
        base = statistics.median(times["none"][0]), statistics.median(times["none"][1])
        for m, (pre, dec) in times.items():
            rows.append({"prompt_tokens": n, "method": m,
                         "prefill_ms": statistics.median(pre) * 1e3,
                         "prefill_ms_rounds": [round(t * 1e3, 1) for t in pre],
                         "prefill_vs_none": statistics.median(pre) / base[0],
                         "decode_tokens_per_s": statistics.median(dec),
                         "decode_vs_none": statistics.median(dec) / base[1]})
    if rank == 0:
        import os
        link = os.environ.get("COMMFUSE_LINK", "loopback" if world > 1 else "none")
        print(f"commfuse generate --bench: {type(model).__name__} through transformers' "
              f"generate, tp={world}, link {link}, {args.max_new_tokens} new tokens, median of "
              f"{args.iters} rounds", flush=True)
        print(f"{'tokens':>7} {'method':<9} {'prefill ms':>10} {'x none':>7} "
              f"{'decode tok/s':>12} {'x none':>7}")
        for r in rows:
            print(f"{r['prompt_tokens']:>7} {r['method']:<9} {r['prefill_ms']:>10.1f} "
                  f"{r['prefill_vs_none']:>7.3f} {r['decode_tokens_per_s']:>12.1f} "
                  f"{r['decode_vs_none']:>7.3f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": getattr(args, "argv", None), "world": world, "link": link,
                           "model": type(model).__name__, "rows": rows}, f, indent=1)
    return 0

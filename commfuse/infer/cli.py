"""``commfuse generate``: text from a Llama, tensor-parallel over --tp ranks with the fused ops.

The model comes from a checkpoint of ``commfuse train --checkpoint-dir DIR`` (any TP/UP/DP
layout: it is read back whole and cut again for --tp; of an ``--hf-config`` run, the
transformers model it saved), from a transformers Llama, Mistral (sliding window too), Qwen2
or Qwen3 saved with ``save_pretrained`` (--hf-model DIR), or is a fresh one (--random-init,
--preset, --seed). Another transformers family that `commfuse.tp.parallelize` takes (Gemma,
Phi-3, OLMo, Mixtral, ...) generates through transformers' own ``generate`` on the sharded
model instead (`commfuse.infer.hf_generate`).
The prompt is prefilled sequence-parallel (each rank embeds and keeps its slice of the
prompt; the fused all-gather -> GEMM and GEMM -> reduce-scatter run every block), or
interleaved in chunks (--prefill-chunks), then one token per step is decoded with the same
weights and a KV cache (`commfuse.infer.model`). Rank 0 streams the text as it comes.
Several --prompt flags make a batch of prompts of different lengths (right-padded), printed
when done.

Local mode spawns --tp ranks; with --link auto (the default) as root they run on the emulated
cluster (`commfuse launch`: a network namespace and shaped link per rank), else on loopback;
under torchrun / commfuse launch the RANK / WORLD_SIZE environment is used.

--bench: generate again with every method (none, sliced, decompose, commfuse, auto; allreduce:
prefill as none, decode replicated; interleaved: prefill in --prefill-chunks chunks, default
the count the cost model predicts fastest, decode as none; compute alone: none moving no
bytes), after a warm-up (in which auto's prefill also tunes its plan to the end, each of
those prefills listed), the rows in turn, --iters times; per method and prompt length the
median prefill latency (--json: every round's too), time to first token and decode tokens/s
(per sequence), their ratio to none, and the simulator's prediction (commfuse.infer.predict).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist

from commfuse.infer.bench import METHODS, bench
from commfuse.infer.loop import Sampling, Timings, generate
from commfuse.ops.auto import add_hardware_flag, use_hardware

DECODE_METHODS = METHODS + ("allreduce",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="The prompt; repeat the flag for a batch of prompts (any lengths)")
    p.add_argument("--prompt-tokens", metavar="N[,N...]",
                   help="Instead of --prompt: a prompt of the corpus's first N tokens (with "
                        "--bench, a comma-separated list of lengths, each measured)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="Tokens to generate per prompt (default: 32)")
    p.add_argument("--tp", type=int, default=2, metavar="N",
                   help="Tensor-parallel ranks: heads and FFN split over them (default: 2)")
    p.add_argument("--method", choices=METHODS, default="auto",
                   help="The fused ops' method for prefill and decode (default: auto, the "
                        "cost model's pick per op shape)")
    p.add_argument("--decode-method", choices=DECODE_METHODS, default=None,
                   help="Decode's instead of --method: also allreduce (every rank all rows, "
                        "two all-reduces per block); auto picks it or the fused ops by the cost "
                        "model (default: --method)")
    p.add_argument("--query-split", action=argparse.BooleanOptionalAction, default=None,
                   help="Prefill attention and out-projection per query slice inside the "
                        "reduce-scatter ring (balanced order), or never (--no-query-split); "
                        "default: where the cost model predicts it faster under --method auto")
    p.add_argument("--prefill-chunks", type=_positive, default=None, metavar="N",
                   help="Prefill interleaved in N chunks of the prompt: each chunk's plain "
                        "collectives (on 2 ranks two all-reduces per block) move while the "
                        "next chunk computes (1: the fused ops; default: under --method auto "
                        "the faster of the fused-op and interleaved prefill, timed on the "
                        "first prompts of each length, else 1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR",
                     help="A commfuse train --checkpoint-dir (its latest) or step directory; "
                          "of an --hf-config run too (a transformers model directory)")
    src.add_argument("--hf-model", metavar="DIR",
                     help="A transformers model saved with save_pretrained (its tokenizer if "
                          "DIR has one, else commfuse's; needs transformers): Llama, Mistral, "
                          "Qwen2, Qwen3 through commfuse's own inference model, the other "
                          "families commfuse.tp.parallelize takes through transformers' "
                          "generate on the sharded model")
    src.add_argument("--random-init", action="store_true",
                     help="A freshly initialised model of --preset (seeded by --seed)")
    p.add_argument("--preset", default="tiny", help="With --random-init: the model (default: "
                   "tiny; see commfuse.models.config.PRESETS)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="Weights and activations (default: the checkpoint's or the saved "
                        "model's, else float32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; otherwise sample from softmax(logits / T) (default: 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="Sample among the K most likely tokens only (0: all; default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="Sample among the most likely tokens of total probability P (default: 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="Sampling seed (the same on every rank) and --random-init's (default: 0)")
    p.add_argument("--bench", action="store_true",
                   help="Measure prefill latency, time to first token and decode tokens/s per "
                        "method (see above) instead of printing text")
    p.add_argument("--iters", type=int, default=3, help="--bench: timed rounds (default: 3)")
    p.add_argument("--json", metavar="FILE", help="--bench: rank 0 writes the results here")
    p.add_argument("--link", default="auto", metavar="RATE",
                   help="Local ranks' network: auto (emulated 1gbit links as root with iproute2, "
                        "else loopback), loopback, or a tc rate such as 200mbit (default: auto; "
                        "ignored under torchrun)")
    add_hardware_flag(p, '; --bench times its sim columns on it too')
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="Seconds a rank waits for a peer before failing (default: 120)")


def run(args) -> int:
    """``commfuse generate``: validate, place the ranks, generate (or bench)."""
    if args.tp < 1 or args.max_new_tokens < 1 or args.iters < 1:
        print("commfuse generate: --tp, --max-new-tokens and --iters must be >= 1",
              file=sys.stderr)
        return 2
    if (args.prompt is None) == (args.prompt_tokens is None):
        print("commfuse generate: give --prompt TEXT or --prompt-tokens N (one of them)",
              file=sys.stderr)
        return 2
    from commfuse.infer import hf_generate
    rank_fn = rank_main
    try:
        Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        _lengths(args)
        from commfuse.infer.load import check_hf, checkpoint_path, is_hf_checkpoint

        if (kind := hf_generate.transformers_family(args)) is not None:  # transformers' generate
            hf_generate.check_args(args, kind)
            rank_fn = hf_generate.rank_main
        elif args.checkpoint and is_hf_checkpoint(args.checkpoint):
            check_hf(checkpoint_path(args.checkpoint), tokenize=True)
        elif args.hf_model:
            check_hf(args.hf_model, tokenize=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"commfuse generate: {e}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not dist.is_initialized():
            from commfuse.runtime.gloo import duplex

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
            duplex()
        rc = rank_fn(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        return rc
    if args.tp == 1:
        return rank_fn(0, 1, args)
    relaunched = _on_emulated_cluster(args)
    if relaunched is not None:
        return relaunched
    from commfuse.testbed.spawn import RankFailed, run_local

    threads = max(1, (os.cpu_count() or 1) // args.tp)
    try:
        return run_local(rank_fn, args.tp, args, threads=threads, timeout=24 * 3600,
                         pg_timeout_s=args.timeout)[0]
    except (RankFailed, TimeoutError) as e:
        print(f"commfuse generate: failed: {e}", file=sys.stderr)
        return 1


def _on_emulated_cluster(args) -> int | None:
    """--link: run this command as --tp ranks on the emulated cluster; None to run it here."""
    if args.link == "loopback":
        return None
    from commfuse.testbed.launch import ClusterSpec, launch
    from commfuse.testbed.links import LinkSpec
    from commfuse.testbed.net import EmulationUnavailable, check_available

    try:
        check_available()
    except EmulationUnavailable as e:
        if args.link != "auto":
            raise SystemExit(f"commfuse generate: --link {args.link}: {e}")
        return None
    rate = "1gbit" if args.link == "auto" else args.link
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    rest = argv[argv.index("generate") + 1:] if "generate" in argv else argv
    print(f"commfuse generate: {args.tp} ranks on the emulated cluster ({rate} links, one core "
          "each; --link loopback to run them on loopback)", file=sys.stderr)
    return launch(ClusterSpec(nproc=args.tp, link=LinkSpec(rate=rate, delay="0us")),
                  [sys.executable, "-m", "commfuse.cli", "generate", *rest])


def _lengths(args) -> list[int]:
    if args.prompt_tokens is None:
        return []
    try:
        lengths = [int(n) for n in str(args.prompt_tokens).split(",")]
    except ValueError:
        raise ValueError(f"--prompt-tokens: not a list of integers: {args.prompt_tokens!r}")
    if not lengths or min(lengths) < 1 or (len(lengths) > 1 and not args.bench):
        raise ValueError("--prompt-tokens: lengths >= 1, several only with --bench")
    return lengths


def build(args, rank: int, world: int, max_len: int):
    """The `InferenceLlama` of this rank and the tokenizer."""
    from commfuse.data import load_tokenizer
    from commfuse.infer.load import (checkpoint_path, hf_tokenizer, is_hf_checkpoint,
                                     load_checkpoint_model, load_hf)
    from commfuse.infer.model import InferenceLlama
    from commfuse.models.llama import Llama, LlamaConfig

    tok = None
    if args.checkpoint:
        model, dtype = load_checkpoint_model(args.checkpoint,
                                             DTYPES[args.dtype] if args.dtype else None)
        if is_hf_checkpoint(args.checkpoint):
            tok = hf_tokenizer(checkpoint_path(args.checkpoint))
    elif args.hf_model:
        model = load_hf(args.hf_model, DTYPES[args.dtype] if args.dtype else None)
        dtype, tok = model.tok_emb.weight.dtype, hf_tokenizer(args.hf_model)
    else:
        torch.manual_seed(args.seed)  # the same model on every rank
        model, dtype = Llama(LlamaConfig.preset(args.preset)), DTYPES[args.dtype or "float32"]
    model.cfg = dataclasses.replace(model.cfg, max_seq_len=max(model.cfg.max_seq_len, max_len))
    group = dist.group.WORLD if world > 1 else None
    opts = {"timeout": args.timeout} if world > 1 else {}
    return InferenceLlama(model.to(dtype), group, args.method, args.query_split,
                          args.decode_method, prefill_chunks=args.prefill_chunks,
                          **opts), tok or load_tokenizer()


def _positive(text: str) -> int:
    if (n := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def rank_main(rank: int, world: int, args) -> int:
    """One rank: generate and stream (rank 0), or bench."""
    from commfuse.data import load_corpus_tokens

    how = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    lengths = _lengths(args)
    corpus = load_corpus_tokens() if lengths else None
    longest = max(lengths) if lengths else 0
    model, tok = build(args, rank, world, max(longest, 4096) + args.max_new_tokens)
    hw, line = use_hardware(args.hardware, model.tok_emb.weight, model.group)
    if rank == 0:
        print(f"commfuse generate: {line}", file=sys.stderr, flush=True)
    if lengths:
        reps = -(-longest // len(corpus))  # the corpus repeated if it is shorter
        prompts = [[corpus.repeat(reps)[:n].tolist()] for n in lengths]
    else:
        prompts = [[tok.encode(t).ids or [0] for t in args.prompt]]
    if args.bench:
        return bench(model, prompts, args, how, rank, world,
                     {"hardware": line, "gemm_flops": hw.gemm_flops})
    show = rank == 0
    batch = prompts[0]
    if show and len(batch) == 1:
        text = tok.decode(batch[0])
        print(text, end="", flush=True)
        ids: list[int] = []

        def stream(tokens_B):
            nonlocal text
            ids.append(int(tokens_B[0]))
            new = tok.decode(batch[0] + ids)
            print(new[len(text):], end="", flush=True)
            text = new
    else:
        stream = None
    timings = Timings()
    out = generate(model, batch, args.max_new_tokens, how, stream, timings)
    if show:
        if len(batch) > 1:
            for i, (p, o) in enumerate(zip(batch, out)):
                print(f"[{i}] {tok.decode(p)}|{tok.decode(o)}", flush=True)
        else:
            print(flush=True)
        print(f"commfuse generate: tp={world} method={args.method}; prefill "
              f"{timings.prefill_s * 1e3:.1f} ms, first token {timings.first_token_s * 1e3:.1f} "
              f"ms, decode {timings.decode_tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return 0

"""``commfuse generate`` for the transformers families its own Llama does not model (Gemma,
Phi-3, OLMo, Mixtral, ... : `commfuse.tp.families`): the saved model sharded by
`commfuse.tp.parallelize` and run by transformers' own ``model.generate`` (prefill on the
fused sequence-sharded path, decode steps replicated, caches of this rank's heads).

`transformers_family` tells `commfuse.infer.cli` which models go here; `check_args`
refuses the flags of the built-in path (--bench, --query-split, --prefill-chunks,
--decode-method); `rank_main` is one rank: load, shard, generate; rank 0 prints the text.
A batch of prompts is left-padded. Mamba-2 models and the hybrids do not generate yet.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

UNSUPPORTED = ("--bench", "--query-split", "--prefill-chunks", "--decode-method")
# conv and recurrent-state caches (Mamba-2's SSM, Gated DeltaNet's) not split yet
NO_GENERATE = ("mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "qwen3_5_text",
               "qwen3_next")


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
    if kind in NO_GENERATE:
        raise ValueError(f"{model_dir(args)}: {kind} models do not generate yet (their conv and "
                         f"recurrent-state caches are not split over the ranks)")
    given = [flag for flag, on in (("--bench", args.bench),
                                   ("--query-split", args.query_split is not None),
                                   ("--prefill-chunks", args.prefill_chunks is not None),
                                   ("--decode-method", args.decode_method is not None)) if on]
    if given:
        raise ValueError(f"{', '.join(given)}: for the built-in Llama path only; a {kind} "
                         f"model generates through transformers' generate")
    if args.prompt_tokens is not None:
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
    if world > 1:
        import commfuse.tp
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
        commfuse.tp.parallelize(model, mesh, method=args.method, timeout=args.timeout)
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
                             pad_token_id=pad, **kw)
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

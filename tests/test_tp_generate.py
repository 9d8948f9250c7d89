"""transformers' own ``model.generate`` on a model sharded by `commfuse.tp.parallelize`,
against the unsharded model's (tiny configs, float32, gloo, 2 ranks, and 4 for one family per
kind of cache): greedy, 12 new tokens, a batch of two prompts of different lengths (left
padding), the tokens equal and every step's logits within 1e-4. The prompt is longer than the
sliding windows and attention chunks (4 tokens) of the families that have them, and the decode
steps cross three more chunk boundaries; prefill runs the fused sequence-sharded path, each
decode step (one token, fewer than the ranks) the replicated one. The Mamba-2 and Gated
DeltaNet mixers' caches hold this rank's conv channels and heads: after the prefill, the
unsharded cache's rows of them. Also: sampling gives every rank the same tokens.
"""

from __future__ import annotations

import copy
import json
import functools

import pytest
import torch

from commfuse.testbed.spawn import run_local
from commfuse.tp.families import FAMILIES as REGISTRY, GENERATE, build

# family -> parallelize options: tied embeddings and windows (gemma3), packed projections
# (phi3), loss_parallel (qwen3: generate gathers the head's columns), MoE (mixtral, qwen3-moe;
# gpt-oss: sinks and expert biases; llama4: shared expert, chunked attention; deepseek-v3: latent
# attention, its cache holding the latents; mamba2 and the hybrids: conv and SSM states of this
# rank's heads; qwen3.5, qwen3-next: Gated DeltaNet's conv and recurrent states)
FAMILIES = {f: {"loss_parallel": True} if f == "qwen3" else {} for f in GENERATE}
# the families with Mamba-2 or Gated DeltaNet mixers: their caches' states checked
STATES = [f for f in FAMILIES if f in REGISTRY and any(
    m.startswith(("Mamba-2", "gated DeltaNet")) for m in REGISTRY[f].mechanisms)]


# 9 prompt tokens + 12 new: past the tiny configs' windows and chunks (4) before the first
# decode step, and across three chunk boundaries while decoding
NEW = 12


def _model(family: str):
    return build(family, max_position_embeddings=128).eval()


def _prompts():
    ids = torch.randint(3, 63, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0  # the second prompt 3 tokens shorter, padded on the left
    return ids, dict(attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def _states(model, ref_cache, cache, rank: int) -> list[str]:
    """Each sharded mixer's conv and recurrent state in ``cache`` against ``ref_cache``'s rows
    of this rank's conv channels and heads (its `MixerLayout` / `DeltaNetLayout`)."""
    out, seen = [], 0
    for name, mixer in model.named_modules():
        lay = getattr(mixer, "_commfuse_layout", None) or getattr(mixer, "_commfuse_deltanet",
                                                                  None)
        if lay is None:
            continue
        seen += 1
        heads = lay.local_heads if hasattr(lay, "local_heads") else lay.local_v_heads
        i = mixer.layer_idx
        want = (ref_cache.layers[i].conv_states[0][:, lay.conv_rows(rank)],
                ref_cache.layers[i].recurrent_states[0][:, rank * heads:(rank + 1) * heads])
        got = (cache.layers[i].conv_states[0], cache.layers[i].recurrent_states[0])
        for what, g, w in zip(("conv", "recurrent"), got, want):
            if g.shape != w.shape or _rel(g, w) > 1e-5:
                out.append(f"{name} {what} state {tuple(g.shape)} vs {tuple(w.shape)}")
    return out if seen else ["no sharded mixer"]


def _check(family: str, mesh) -> dict[str, list[str]]:
    import torch.distributed as dist

    import commfuse.tp as tp
    ref = _model(family)
    model = tp.parallelize(copy.deepcopy(ref), mesh, method="commfuse", **FAMILIES[family])
    ids, kw = _prompts()
    gen = dict(do_sample=False, return_dict_in_generate=True, output_logits=True, **kw)
    want, got = ref.generate(ids, **gen), model.generate(ids, **gen)
    rel = max(_rel(g, w) for g, w in zip(got.logits, want.logits))
    out = {f"greedy-{family}": [] if torch.equal(got.sequences, want.sequences) and rel < 1e-4
           else [f"{got.sequences} vs {want.sequences}, logits rel {rel:.1e}"]}
    if family in STATES:
        with torch.no_grad():
            caches = [m(ids, attention_mask=kw["attention_mask"], use_cache=True)
                      .cache for m in (ref, model)]
        out[f"cache-{family}"] = _states(model, *caches, mesh.get_local_rank())
    torch.manual_seed(11)
    sampled = model.generate(ids, do_sample=True, top_k=8, **{**kw, "max_new_tokens": 8})
    every = [torch.empty_like(sampled) for _ in range(mesh.size())]
    dist.all_gather(every, sampled, group=mesh.get_group())
    out[f"sampled-{family}"] = [] if all(torch.equal(s, sampled) for s in every) else [
        "ranks sampled different tokens"]
    return out


# every family on 2 ranks; on 4, one per kind of cache: KV of this rank's heads with sinks and
# windows (gpt-oss), latents (deepseek-v3), Mamba-2 states (nemotron-h), Gated DeltaNet
# states (qwen3.5)
ON = {2: tuple(FAMILIES), 4: ("gpt-oss", "deepseek-v3", "nemotron-h", "qwen3.5")}


def _run(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for family in ON[world]:
        out.update(_check(family, mesh))
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_local(_run, world, timeout=600, pg_timeout_s=60)


CASES = [(w, f"{k}-{f}") for w in (2, 4) for f in ON[w] for k in ("greedy", "sampled")]
CASES += [(w, f"cache-{f}") for w in (2, 4) for f in STATES if f in ON[w]]


@pytest.mark.parametrize("world,case", CASES, ids=[f"{w}-{c}" for w, c in CASES])
def test_generate_matches_unsharded_model(world, case):
    problems = {r: res[case] for r, res in enumerate(results(world)) if res[case]}
    assert not problems, problems


def test_cli_generates_other_families_through_transformers(tmp_path, command):
    """``commfuse generate --hf-model`` on a family its own Llama does not model (Gemma 3:
    tied embeddings, windows) runs transformers' generate on the sharded model: the same text
    on 1 and 2 ranks (a batch of two prompts); --bench times every method's prefill and
    decode; the built-in path's flags are refused before any rank starts."""
    from commfuse.tp.families import tiny_config
    import transformers
    cfg = tiny_config("gemma3", vocab_size=4096, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(tmp_path / "g")
    texts = []
    for tp in ("1", "2"):
        p = command("generate", "--hf-model", str(tmp_path / "g"), "--prompt", "ROMEO: what",
                    "--prompt", "To be", "--max-new-tokens", "6", "--tp", tp, "--link",
                    "loopback")
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.startswith("[0] ROMEO: what|") and "[1] To be|" in p.stdout
        texts.append(p.stdout)
    assert texts[0] == texts[1]
    p = command("generate", "--hf-model", str(tmp_path / "g"), "--prompt", "a",
                "--query-split", "--tp", "2", "--link", "loopback")
    assert p.returncode == 2 and "--query-split: for the built-in Llama path only" in p.stderr
    p = command("generate", "--hf-model", str(tmp_path / "g"), "--prompt-tokens", "16,24",
                "--bench", "--iters", "1", "--max-new-tokens", "3", "--tp", "2", "--link",
                "loopback", "--json", str(tmp_path / "b.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["prompt_tokens"], r["method"]) for r in rows] == [
        (n, m) for n in (16, 24) for m in ("none", "sliced", "commfuse", "auto")]
    assert all(r["prefill_ms"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)


# shipped configs whose checkpoints gather rows back into the model's layout: gpt-oss-tiny
# (experts, sinks), qwen3.5-tiny (Gated DeltaNet's assembled in_proj and conv1d rows; Mamba-2's
# are checked by test_train_mamba's checkpoint test)
ROUND_TRIP = ("gpt-oss-tiny", "qwen3.5-tiny")


@pytest.mark.parametrize("config", ROUND_TRIP)
def test_train_then_generate_round_trip(tmp_path, command, config):
    """``commfuse train --hf-config CONFIG --tp 2 --checkpoint-dir D`` then ``commfuse generate
    --checkpoint D --tp 2``: transformers' greedy tokens of the saved model (experts, sinks,
    the mixers' assembled in_proj / conv1d rows gathered back into the model's layout;
    generate's cache on even where the shipped config turns it off, as nemotron-h-tiny's
    does)."""
    import transformers

    from commfuse.data import load_tokenizer
    root = str(tmp_path / "run")
    p = command("train", "--hf-config", config, "--tp", "2", "--steps", "2",
                "--seq-len", "16", "--batch-size", "2", "--link", "loopback",
                "--checkpoint-dir", root)
    assert p.returncode == 0, p.stderr[-2000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        f"{root}/{open(f'{root}/latest').read().strip()}").eval()
    tok = load_tokenizer()
    prompt = tok.encode("ROMEO: what").ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    p = command("generate", "--checkpoint", root, "--prompt", "ROMEO: what",
                "--max-new-tokens", "6", "--tp", "2", "--link", "loopback")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == f"ROMEO: what|{tok.decode(want)}\n"

"""Generation (`commfuse.infer`) for every architecture `commfuse.tp` trains: Qwen2 (q/k/v
biases), Qwen3 (q/k norms, heads wider than hidden / heads), Mistral with a sliding window
shorter than the prompts, Qwen2 with a window on its upper layer only. Greedy tokens equal
transformers' own ``generate`` on 1, 2 and 4 ranks with every prefill and decode plan; a
checkpoint of ``commfuse train --hf-config --checkpoint-dir`` generates transformers' tokens
through ``commfuse generate --checkpoint`` and on 2 ranks. One spawn per world size runs
every case."""

import contextlib
import importlib.util
import io

import pytest
import torch

from commfuse.infer import InferenceLlama, generate
from commfuse.infer.load import load_checkpoint_model
from commfuse.testbed.spawn import run_local

# transformers is imported where it is used, not by the ranks (which load this module)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers")

PROMPTS = [[3, 17, 99, 5, 250, 8, 41, 7, 7, 100, 4], [200], [9, 9, 1, 77, 130]]
NEW = 6
WINDOW = 4  # below two of the prompts' lengths (11, 5): the window hides keys in prefill too
ARCHS = {"qwen2": ("Qwen2", {}),
         "qwen3": ("Qwen3", {"head_dim": 16}),  # heads wider than hidden / heads (8)
         "mistral-window": ("Mistral", {"sliding_window": WINDOW}),
         "qwen2-window": ("Qwen2", {"use_sliding_window": True, "sliding_window": 3,
                                    "max_window_layers": 1})}
# (method, decode_method, prefill_chunks) per world size: in one process the methods are plain
# GEMMs alike; on 2 ranks the fused ops, auto, decode by all-reduce, interleaved prefill
PLANS = {1: [("none", None, None), ("none", None, 2)],
         2: [("none", None, None), ("commfuse", None, None), ("auto", None, None),
             ("commfuse", "allreduce", None), ("none", None, 2)],
         4: [("commfuse", None, None), ("auto", None, None), ("commfuse", "allreduce", None),
             ("none", None, 2)]}


def hf_model(arch: str, **over):
    """A tiny random transformers model (8 heads, 4 kv heads), float64, its biases and norm
    gains random too (transformers starts them at 0 and 1, where a lost bias or norm would
    not show)."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{arch}Config")(**{
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64,
        "tie_word_embeddings": False, **over})
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
    return model


def greedy(hf) -> list[list[int]]:
    """transformers' greedy tokens after each prompt, one prompt at a time (no padding)."""
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            new = hf.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))
            out.append(new[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """{name: (saved model, transformers' greedy tokens)}; the window shown to matter."""
    root = tmp_path_factory.mktemp("arch")
    out = {}
    for name, (arch, over) in ARCHS.items():
        hf = hf_model(arch, **over)
        hf.save_pretrained(root / name)
        out[name] = (str(root / name), greedy(hf))
    full = hf_model("Mistral", sliding_window=None)
    assert greedy(full) != out["mistral-window"][1]  # same weights, no window: other tokens
    return out


def _rank(rank, world, models):
    """Every case (our model, read in the parent) with every plan on this rank: the (case,
    plan, tokens) that differ from transformers', and the message of query-split refused
    under a window."""
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    wrong = []
    for name, (model, want) in models.items():
        for method, decode, chunks in PLANS[world]:
            m = InferenceLlama(model, group, method, decode_method=decode,
                               prefill_chunks=chunks)
            got = generate(m, PROMPTS, NEW)
            if got != want:
                wrong.append((name, method, decode, chunks, got, want))
    refused = None
    if group is not None:
        m = InferenceLlama(models["mistral-window"][0], group, "commfuse", query_split=True)
        try:
            generate(m, PROMPTS, 1)
        except ValueError as e:
            refused = str(e)
    return wrong, refused


@pytest.mark.parametrize("world", [1, 2, 4])
def test_greedy_tokens_equal_transformers(cases, request, world):
    """Qwen2, Qwen3, sliding-window Mistral and Qwen2: every plan's greedy tokens for a batch
    of prompts of lengths 11, 1 and 5 are transformers' ``generate``'s on every rank (the
    windowed layers' caches a ring of W slots); on 2 ranks also those of the trained
    ``--hf-config`` checkpoint; query-split, causal over the whole prompt, refused under a
    shorter window."""
    if world == 2:
        cases = {**cases, "trained": request.getfixturevalue("trained")}
    if world == 1:  # the windowed layers keep a ring of WINDOW slots, the others every position
        m = InferenceLlama(load_checkpoint_model(cases["qwen2-window"][0])[0])
        assert [t.shape[2] for t in m.new_cache(2, 20).k] == [20, 3]
        m = InferenceLlama(load_checkpoint_model(cases["mistral-window"][0])[0])
        assert [t.shape[2] for t in m.new_cache(2, 20).k] == [WINDOW, WINDOW]
    # a saved model, or a run's directory (its latest)
    models = {name: (load_checkpoint_model(path)[0], want) for name, (path, want) in cases.items()}
    results = [_rank(0, 1, models)] if world == 1 else run_local(_rank, world, models,
                                                                   timeout=600)
    for wrong, refused in results:
        assert not wrong, wrong[0]
        if world > 1:
            assert refused and "sliding window shorter than the prompt" in refused, refused


TRAIN = dict(hf_config="qwen2-tiny", steps=2, seq_len=15, batch_size=2, progress=False,
             peak_flops=1e9, exposed_iters=0, method="commfuse", hardware="cpu-testbed")


def _train(root, tp: int):
    """The step directory of a 2-step ``--hf-config qwen2-tiny --checkpoint-dir root`` run."""
    from commfuse.train.config import TrainConfig
    from commfuse.train.loop import launch

    launch(TrainConfig(tp=tp, checkpoint_dir=str(root), **TRAIN))
    return root / (root / "latest").read_text().strip()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the directory of a 2-step ``--hf-config qwen2-tiny`` run on 2 ranks saved with
    --checkpoint-dir, transformers' greedy tokens from its latest)."""
    import transformers

    root = tmp_path_factory.mktemp("trained")
    step = _train(root, 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(step).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    return str(root), greedy(hf)


def test_hf_checkpoint_holds_the_trained_weights(trained, tmp_path):
    """The 2-rank run's checkpoint is the whole model: every weight (q/k/v biases, the k/v
    projections of 2 kv heads, the row-parallel o/down columns) as the same run in one
    process trains it, within what 2 Adam steps make of the ranks' rounding (a shard in
    the wrong place would be off by the weight's own size)."""
    from safetensors.torch import load_file

    root, _ = trained
    two = load_file(f"{root}/{open(f'{root}/latest').read().strip()}/model.safetensors")
    one = load_file(_train(tmp_path, 1) / "model.safetensors")
    assert two.keys() == one.keys() and any(k.endswith("k_proj.bias") for k in one)
    for k in one:
        assert two[k].shape == one[k].shape, k
        assert (two[k] - one[k]).abs().max() <= 0.02 * one[k].abs().max(), k


def test_generate_cli_reads_hf_config_checkpoint(trained):
    """``commfuse generate --checkpoint D`` on the run's directory (its latest) prints the
    prompt and transformers' greedy continuation from that checkpoint."""
    import transformers

    from commfuse import cli
    from commfuse.data import load_corpus_tokens, load_tokenizer

    root, _ = trained
    prompt = load_corpus_tokens()[:9].tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        f"{root}/{open(f'{root}/latest').read().strip()}").eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)[0].tolist()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["generate", "--checkpoint", root, "--prompt-tokens", "9",
                       "--max-new-tokens", "4", "--tp", "1", "--hardware", "cpu-testbed"])
    assert rc == 0, err.getvalue()[-2000:]
    assert out.getvalue() == load_tokenizer().decode(want) + "\n"  # streamed, then a newline


def test_unsupported_named():
    """What is not modelled is refused with the missing piece named."""
    import transformers

    from commfuse.models.llama import config_from_hf

    for cfg, why in ((transformers.LlamaConfig(mlp_bias=True), "mlp_bias"),
                     (transformers.LlamaConfig(attention_bias=True), "bias on o_proj"),
                     (transformers.GemmaConfig(), "model_type 'gemma'")):
        with pytest.raises(ValueError, match=why):
            config_from_hf(cfg)

"""commfuse.infer on a transformers Llama (`load_hf`, `commfuse generate --hf-model`): greedy
tokens and logits against transformers' own forward and ``generate``, on 1, 2 and 4 ranks;
the command on a saved model; and what it refuses, before any rank starts."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from commfuse.infer import InferenceLlama, generate, load_hf, pad_prompts  # noqa: E402
from commfuse.testbed.spawn import run_local  # noqa: E402
from test_infer_cli import _refused  # noqa: E402

PROMPTS = [[3, 17, 99, 5, 250, 8, 41], [200], [9, 9, 1, 77, 130]]
NEW = 6


def hf_model(arch="Llama", **over):
    """A tiny random transformers Llama (or Mistral, no sliding window; GQA: 12 heads, 4 kv
    heads), float64."""
    torch.manual_seed(0)
    if arch == "Mistral":
        over = {"sliding_window": None, **over}
    cfg = getattr(transformers, f"{arch}Config")(**{
        "vocab_size": 256, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 64,
        "rope_theta": 10000.0, "tie_word_embeddings": False, **over})
    return getattr(transformers, f"{arch}ForCausalLM")(cfg).to(torch.float64).eval()


def _reference(hf):
    """transformers' greedy tokens and its logits at each prompt's last position."""
    tokens, logits = [], []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = hf.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))
            tokens.append(out[0, len(p):].tolist())
            logits.append(hf(ids).logits[0, -1])
    return tokens, torch.stack(logits)


def _hf_rank(rank, world, path):
    import torch.distributed as dist

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    hf.eval()
    want_tokens, want_logits = _reference(hf)
    group = dist.group.WORLD if world > 1 else None
    got = {}
    for method in ("none", "commfuse", "auto"):
        m = InferenceLlama(load_hf(path), group, method)
        got[method] = generate(m, PROMPTS, NEW)
    m = InferenceLlama(load_hf(path), group, "commfuse")
    tokens, lengths = pad_prompts(PROMPTS)
    logits = m.prefill(tokens, lengths, m.new_cache(len(PROMPTS), tokens.shape[1]))
    return want_tokens, got, (logits - want_logits).abs().max().item()


@pytest.mark.parametrize("arch,world", [("Llama", 1), ("Llama", 2), ("Llama", 4),
                                        ("Mistral", 2)])
def test_hf_llama_tokens_equal_transformers(tmp_path, arch, world):
    """Every rank's greedy tokens (none, commfuse, auto) are transformers' ``generate``'s,
    and the prefill's logits its forward's within float64 rounding."""
    hf_model(arch).save_pretrained(tmp_path / "m")
    if world == 1:
        results = [_hf_rank(0, 1, str(tmp_path / "m"))]
    else:
        results = run_local(_hf_rank, world, str(tmp_path / "m"), timeout=300)
    for want, got, err in results:
        for method, tokens in got.items():
            assert tokens == want, (world, method)
        assert err < 1e-10, err


def test_cli_generate_hf_model(tmp_path, command):
    """--hf-model: the same text on 1 and 2 ranks, its vocabulary checked against commfuse's
    tokenizer (no tokenizer of its own saved), and models it does not take refused with the
    reason, before any rank starts."""
    hf_model(vocab_size=4096).save_pretrained(tmp_path / "m")
    texts = []
    for tp in ("1", "2"):
        p = command("generate", "--hf-model", str(tmp_path / "m"), "--prompt",
                    "The history of", "--max-new-tokens", "5", "--tp", tp, "--link", "loopback",
                    "--hardware", "cpu-testbed")
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.startswith("The history of")
        texts.append(p.stdout)
    assert texts[0] == texts[1]
    # a preset: the fit to measured rates is tests/test_infer_cli.py's bench
    p = command("generate", "--hf-model", str(tmp_path / "m"), "--prompt-tokens", "9", "--bench",
                "--iters", "1", "--max-new-tokens", "2", "--tp", "2", "--link", "loopback",
                "--hardware", "cpu-testbed", "--json", str(tmp_path / "b.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(json.loads((tmp_path / "b.json").read_text())["rows"]) == 8
    hf_model().save_pretrained(tmp_path / "small-vocab")
    hf_model(vocab_size=4096, attention_bias=True).save_pretrained(tmp_path / "bias")
    hf_model(vocab_size=4096, mlp_bias=True).save_pretrained(tmp_path / "mlp-bias")
    for path, why in ((tmp_path / "small-vocab", "below commfuse's tokenizer's 4096"),
                      (tmp_path / "bias", "attention_bias"),
                      (tmp_path / "mlp-bias", "mlp_bias"),
                      (tmp_path / "nothing", "not a transformers model directory")):
        rc, err = _refused("--hf-model", str(path), "--prompt", "a", "--tp", "2", "--link",
                           "loopback")
        assert rc == 2 and why in err, err[-2000:]

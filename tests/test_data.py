"""The shipped corpus and tokenizer, and the deterministic, resumable batch iterator."""

import itertools

import pytest
import torch

from commfuse.data import (
    CORPUS_PATH,
    DATA_DIR,
    TOKENIZER_PATH,
    VOCAB_SIZE,
    _encode,
    batches,
    load_corpus_text,
    load_corpus_tokens,
    load_tokenizer,
    train_tokenizer,
)


def take(it, n):
    return list(itertools.islice(it, n))


# --- corpus and tokenizer --------------------------------------------------------------------


def test_corpus_is_shipped_small_and_clean():
    assert CORPUS_PATH.stat().st_size <= 3 * 2**20
    text = load_corpus_text()
    assert text.startswith("Hamlet\n") and "To be, or not to be" in text
    assert "Project Gutenberg" not in text and "**" not in text and "\\" not in text
    assert (DATA_DIR / "README.md").exists()


def test_tokenizer_round_trip():
    pytest.importorskip("tokenizers")
    tok = load_tokenizer()
    assert tok.get_vocab_size() == VOCAB_SIZE
    assert tok.token_to_id("<|endoftext|>") == 0
    text = load_corpus_text()[100_000:120_000]
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # it compresses: about 3 characters per token
    odd = "naïve café — 東京 🤖\ttabs\r\n  spaces  "  # bytes it never saw still round-trip
    assert tok.decode(tok.encode(odd).ids) == odd


def test_shipped_tokenizer_is_reproducible():
    pytest.importorskip("tokenizers")
    fresh = train_tokenizer(load_corpus_text(), VOCAB_SIZE)
    assert fresh.to_str() == load_tokenizer().to_str()  # else: python scripts/train_tokenizer.py


def test_corpus_tokens_deterministic_and_cached(tmp_path):
    pytest.importorskip("tokenizers")
    _encode.cache_clear()
    tokens = load_corpus_tokens(cache_dir=tmp_path)
    assert tokens.dtype == torch.long and tokens.dim() == 1 and tokens.numel() > 500_000
    assert 0 <= tokens.min() and tokens.max() < VOCAB_SIZE
    assert list(tmp_path.glob("corpus-tokens-*.pt"))
    tokens[:10] = -1  # a copy: the cache is unaffected
    _encode.cache_clear()  # the next call reads the disk cache
    again = load_corpus_tokens(cache_dir=tmp_path)
    assert torch.equal(again, load_corpus_tokens(cache_dir=tmp_path))
    assert (again[:10] >= 0).all()
    head = load_tokenizer().decode(again[:200].tolist())
    assert load_corpus_text().startswith(head)
    direct = load_tokenizer(TOKENIZER_PATH).encode(load_corpus_text()[:5000]).ids
    assert again[:1000].tolist() == direct[:1000]


# --- batches -----------------------------------------------------------------------------------

TOKENS = torch.arange(10_000)  # token value == position, so a window shows where it starts


def test_batch_shapes_and_shift():
    inputs, targets = next(batches(TOKENS, batch_size=3, seq_len=16, seed=0))
    assert inputs.shape == targets.shape == (3, 16) and inputs.dtype == torch.long
    assert torch.equal(targets, inputs + 1)
    assert inputs.is_contiguous() and targets.is_contiguous()


def test_batches_deterministic_per_seed():
    a = take(batches(TOKENS, 4, 32, seed=1), 5)
    b = take(batches(TOKENS, 4, 32, seed=1), 5)
    c = take(batches(TOKENS, 4, 32, seed=2), 5)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


@pytest.mark.parametrize("start", [0, 1, 7, 150])  # 150 crosses several epoch boundaries
def test_resume_sees_the_same_batches(start):
    full = take(batches(TOKENS, 4, 32, seed=3, rank=1, world=2), start + 5)
    resumed = take(batches(TOKENS, 4, 32, seed=3, rank=1, world=2, start_step=start), 5)
    for (x, y), (rx, ry) in zip(full[start:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_split_the_global_batch(world):
    single = take(batches(TOKENS, 2 * world, 16, seed=4), 40)
    per_rank = [take(batches(TOKENS, 2, 16, seed=4, rank=r, world=world), 40) for r in range(world)]
    for step in range(40):
        joined = torch.cat([per_rank[r][step][0] for r in range(world)])
        assert torch.equal(joined, single[step][0])


def test_an_epoch_reads_every_window_once():
    seq_len, n = 10, (TOKENS.numel() - 10) // 10
    starts = torch.cat([x[:, 0] for x, _ in take(batches(TOKENS, 9, seq_len, seed=5), n // 9)])
    offset = int(starts[0]) % seq_len
    assert (starts % seq_len == offset).all()
    assert sorted(((starts - offset) // seq_len).tolist()) == list(range(len(starts)))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(batch_size=0), "batch_size and seq_len"),
        (dict(seq_len=0), "batch_size and seq_len"),
        (dict(rank=2, world=2), "rank < world"),
        (dict(start_step=-1), "start_step"),
        (dict(seq_len=6000), "too few"),
    ],
)
def test_batch_argument_errors(kw, match):
    args = {**dict(batch_size=2, seq_len=8, seed=0), **kw}
    with pytest.raises(ValueError, match=match):  # at the call, not at the first batch
        batches(TOKENS, **args)

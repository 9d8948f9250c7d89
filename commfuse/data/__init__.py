"""The training data: a public-domain corpus shipped in the repo, its BPE tokenizer, and batches.

- `corpus.txt`: 22 plays of Shakespeare, plain text (source and licence in README.md here).
- `tokenizer.json`: a byte-level BPE with 4096 tokens trained on it (`scripts/train_tokenizer.py`).
- `batches(...)`: a deterministic, resumable iterator of (inputs, targets) for data parallelism.

The tokenizer needs the `tokenizers` package, imported lazily so that `batches` (and the rest of
the package) loads without it.

Shape suffixes: B batch (per rank), S sequence length, N tokens in the corpus.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parent
CORPUS_PATH = DATA_DIR / "corpus.txt"
TOKENIZER_PATH = DATA_DIR / "tokenizer.json"
VOCAB_SIZE = 4096
EOT = "<|endoftext|>"  # the one special token, id 0; the shipped corpus does not use it


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "commfuse.data's tokenizer needs the 'tokenizers' package: pip install tokenizers"
        ) from e
    return tokenizers


def train_tokenizer(text: str, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE (GPT-2 style: any byte string round-trips) on `text`.

    Deterministic: the same text and vocab_size give the same tokenizer.json.
    """
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path = TOKENIZER_PATH):
    """The shipped tokenizer, a `tokenizers.Tokenizer` (encode(text).ids, decode(ids))."""
    return _tokenizers().Tokenizer.from_file(str(path))


def load_corpus_text(path: str | Path = CORPUS_PATH) -> str:
    return Path(path).read_text(encoding="utf-8")


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "commfuse"


@functools.lru_cache(maxsize=4)
def _encode(corpus_path: Path, tokenizer_path: Path, cache_dir: Path | None) -> torch.Tensor:
    h = hashlib.sha256(corpus_path.read_bytes())
    h.update(tokenizer_path.read_bytes())
    h.update(_tokenizers().__version__.encode())
    cached = None if cache_dir is None else cache_dir / f"corpus-tokens-{h.hexdigest()[:24]}.pt"
    if cached is not None and cached.exists():
        try:
            return torch.load(cached, weights_only=True).long()
        except Exception:  # a damaged cache file is re-encoded and rewritten below
            pass
    ids = load_tokenizer(tokenizer_path).encode(load_corpus_text(corpus_path)).ids
    tokens_N = torch.tensor(ids, dtype=torch.long)
    if cached is not None:
        try:  # best effort; the write is atomic, so concurrent ranks cannot read half a file
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            torch.save(tokens_N.to(torch.int32), tmp)
            os.replace(tmp, cached)
        except OSError:
            pass
    return tokens_N


def load_corpus_tokens(
    corpus_path: str | Path = CORPUS_PATH,
    tokenizer_path: str | Path = TOKENIZER_PATH,
    disk_cache: bool = True,
    cache_dir: str | Path | None = None,
) -> torch.Tensor:
    """The whole corpus encoded as one LongTensor tokens_N (deterministic).

    Encoding the shipped corpus takes a few seconds, so the result is cached: in memory per
    process, and (if disk_cache) in `cache_dir` (default $XDG_CACHE_HOME/commfuse, else
    ~/.cache/commfuse), keyed by a hash of both files and the tokenizers version. Each call
    returns a fresh copy, so callers may modify it.
    """
    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    return _encode(
        Path(corpus_path).resolve(), Path(tokenizer_path).resolve(), cache if disk_cache else None
    ).clone()


def _epoch_permutation(seed: int, epoch: int, n: int, seq_len: int) -> tuple[int, torch.Tensor]:
    """(offset, order) of epoch `epoch`: where the windows start and the order they are read in."""
    digest = hashlib.sha256(f"commfuse.data:{seed}:{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    offset = int(torch.randint(seq_len, (1,), generator=g))
    return offset, torch.randperm(n, generator=g)


def batches(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    world: int = 1,
    start_step: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs_BS, targets_BS) for this rank, targets being inputs shifted by one token.

    The corpus is cut into n = (N - seq_len) // seq_len windows of seq_len + 1 tokens, starting at
    a random offset < seq_len drawn per epoch; each epoch reads all n windows in a random order
    (sampling without replacement). Step s takes the global samples s*G .. (s+1)*G - 1 of that
    stream, G = batch_size * world, and rank r gets samples r*batch_size .. (r+1)*batch_size - 1
    of the step. So:
    - every batch is a pure function of (tokens, seed, batch_size * world, seq_len, step): a run
      resumed at `start_step` sees exactly the batches of an uninterrupted run, and jumping there
      costs nothing;
    - the ranks of one step read disjoint windows, and their concatenation in rank order is the
      batch that world=1 with batch_size*world would read (a data-parallel run and its
      single-process reference see the same data).
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    n = (tokens.numel() - seq_len) // seq_len
    if n < 1:
        raise ValueError(f"{tokens.numel()} tokens are too few for seq_len={seq_len}")
    return _batches(tokens.long(), batch_size, seq_len, seed, rank, world, start_step, n)


def _batches(tokens, batch_size, seq_len, seed, rank, world, start_step, n):
    cols_S1 = torch.arange(seq_len + 1, device=tokens.device)
    epoch, offset, perm = -1, 0, None
    for step in itertools.count(start_step):
        first = (step * world + rank) * batch_size
        starts = []
        for sample in range(first, first + batch_size):
            if sample // n != epoch:
                epoch = sample // n
                offset, perm = _epoch_permutation(seed, epoch, n, seq_len)
            starts.append(offset + int(perm[sample % n]) * seq_len)
        windows_BS1 = tokens[torch.tensor(starts, device=tokens.device)[:, None] + cols_S1]
        yield windows_BS1[:, :-1].contiguous(), windows_BS1[:, 1:].contiguous()

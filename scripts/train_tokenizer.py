"""Regenerate commfuse/data/tokenizer.json: a byte-level BPE trained on commfuse/data/corpus.txt.

    python scripts/train_tokenizer.py                 # rewrite the shipped tokenizer
    python scripts/train_tokenizer.py --check         # exit 1 if the shipped one differs

Training is deterministic, so rerunning it on the shipped corpus reproduces the shipped file.
Needs the `tokenizers` package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from commfuse.data import CORPUS_PATH, TOKENIZER_PATH, VOCAB_SIZE, train_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=CORPUS_PATH,
                        help="UTF-8 text to train on (default: the shipped corpus.txt)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                        help="tokens in the vocabulary, the special one included "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=TOKENIZER_PATH,
                        help="where to write tokenizer.json (default: the shipped one)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if --out differs from a fresh training")
    args = parser.parse_args(argv)

    tokenizer = train_tokenizer(args.corpus.read_text(encoding="utf-8"), args.vocab_size)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "tokenizer.json"
            tokenizer.save(str(fresh))
            same = args.out.exists() and fresh.read_bytes() == args.out.read_bytes()
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from a fresh training'}")
        return 0 if same else 1
    tokenizer.save(str(args.out))
    print(f"wrote {args.out}: {tokenizer.get_vocab_size()} tokens, trained on {args.corpus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

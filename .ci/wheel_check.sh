#!/usr/bin/env bash
# CI: the package as a user gets it. Build the sdist and, from it, the wheel, with PYTHON's
# own setuptools (--no-isolation: no throwaway build venv per step); install the wheel in a
# fresh venv (torch pinned: an unpinned one pulls a multi-GB CUDA build; --no-compile: the
# few modules a run imports are compiled when imported, not torch's thousands of files at
# install); then, from a directory outside the repository (so nothing imports from the source
# tree), check the version, the shipped data files and a short training run (the fused ops on
# 2 ranks; the demo's ops and methods are the test suite's).
# Usage: .ci/wheel_check.sh [PYTHON]   (PYTHON has `build` and setuptools: the dev extra;
# default .venv's)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$repo/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$py" -m build --no-isolation --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/commfuse-*.whl)
echo "built $(basename "$wheel")"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --no-compile torch==2.13.0 "$wheel"

cd "$work"
"$work/venv/bin/commfuse" --version
"$work/venv/bin/python" - <<'EOF'
import importlib.metadata as md
from pathlib import Path

import commfuse
from commfuse.data import DATA_DIR

assert "site-packages" in commfuse.__file__, commfuse.__file__  # the wheel's, not the tree's
assert commfuse.__version__ == md.version("commfuse"), commfuse.__version__
assert md.metadata("commfuse")["License-Expression"] == "Apache-2.0"
for name in ("corpus.txt", "tokenizer.json", "README.md", "hf/llama-tiny.json"):
    assert (Path(DATA_DIR) / name).stat().st_size > 0, name
print("wheel: version, license and data files ok")
EOF
"$work/venv/bin/commfuse" train --steps 3 --seq-len 32 --batch-size 2 --link loopback \
    --hardware cpu-testbed --peak-flops 1e11

#!/usr/bin/env bash
# The CUDA path's checks on a machine with a GPU, in one go (under 8 minutes), their report
# kept under docs/benchmarks/gpu/DATE/: check_gpu.json (rewritten after each check, so a run
# cut short by the time limit keeps what it measured), log.txt, and the machine's nvidia-smi.
#   bash scripts/gpu_check.sh            # PYTHON=... to use another interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
out="docs/benchmarks/gpu/$(date -u +%Y-%m-%d)"
mkdir -p "$out"
python="${PYTHON:-.venv/bin/python}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
timeout --kill-after=10 470 "$python" -m commfuse.check_gpu --require-gpu --out "$out" \
    2>&1 | tee "$out/log.txt"
rc=${PIPESTATUS[0]}
echo "exit status $rc (124: cut at 470 s; the JSON holds the checks that finished): $out" \
    | tee -a "$out/log.txt"
exit "$rc"

#!/usr/bin/env bash
# One command for a GPU machine (≤ 8 minutes, nothing downloaded): drafter train-step throughput and MFU with
# compiled FlexAttention vs SDPA for Qwen3-0.6B- and Qwen3-8B-shaped random targets, peak memory, eval speed.
# `--tiny` runs the same code on CPU with tiny shapes (the tests do, so it cannot rot).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@"

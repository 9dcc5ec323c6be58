#!/usr/bin/env bash
# One command for a GPU machine (≤ 6 minutes, nothing downloaded): target-only decoding against the bandwidth
# bound on each of eval's machineries, a speculative step in target tokens, eval's own per-dataset report, and
# the CLI's training step beside the isolated one with a profile of the difference (benchmarks/gpu_eval.py).
# `--tiny` runs the same code on CPU with tiny shapes (the tests do, so it cannot rot).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec timeout 360 "$PYTHON" benchmarks/gpu_eval.py "$@"

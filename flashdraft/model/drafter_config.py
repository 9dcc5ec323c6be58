"""A drafter directory's config.json, read once at the edge into one value that the steps after it are handed.

    drafter = read_drafter_config(drafter_dir)     # eval, export: before any work
    drafter.spec_type, drafter.block_size, drafter.raw

Reading it is where every check of it lives: a regular file (never through a link), at most MAX_JSON_BYTES, JSON
of an architecture flashdraft exports, with the fields a DFlash drafter has; `auto_map` (a reference to Python code
for transformers to import) removed. Later steps use this value — the pairing with the target, the engines' draft
type, the staging copy handed to llama.cpp's converter — so none of them reads a file that may have changed since
it was checked, and no check is written twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.bounded import read_small
from flashdraft.errors import BadInput
from flashdraft.layout import hub_download_hint
from flashdraft.model.staging import DRAFTER_ARCHITECTURES, MAX_JSON_BYTES, regular_file, strip_code_references


@dataclass(frozen=True)
class DrafterConfig:
    directory: Path
    raw: dict[str, Any]  # as read, without auto_map
    architecture: str
    block_size: int
    spec_type: str  # llama.cpp's --spec-type: draft-dspark for a DSpark drafter, else draft-dflash

    @property
    def dspark(self) -> bool:
        return self.spec_type == "draft-dspark"


def read_drafter_config(drafter_dir: str | Path) -> DrafterConfig:
    """The drafter at `drafter_dir`, checked, or BadInput in one line saying what is wrong (eval and export ask
    before any work)."""
    if hub := hub_download_hint(str(drafter_dir)):
        raise BadInput(hub)
    directory = Path(drafter_dir)
    path = regular_file(directory / "config.json")
    if path is None:
        raise BadInput(f"{directory} holds no drafter (config.json): run `flashdraft train` first")
    try:
        raw = strip_code_references(json.loads(read_small(path, MAX_JSON_BYTES)))
    except ValueError as e:
        raise BadInput(f"{directory}/config.json is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{directory}/config.json is not a model config (a JSON object)")
    names = raw.get("architectures") or []
    if len(names) != 1 or names[0] not in DRAFTER_ARCHITECTURES:
        raise BadInput(f"{directory}/config.json names architectures {names}: a drafter's must be one of "
                       f"{', '.join(DRAFTER_ARCHITECTURES)}")
    block_size = (raw.get("dflash_config") or {}).get("block_size") or raw.get("block_size")
    if not isinstance(block_size, int) or block_size < 2:
        raise BadInput(f"{directory}/config.json gives no block size (block_size, dflash_config.block_size)")
    return DrafterConfig(directory, raw, names[0], block_size, served_spec_type(raw, directory))


def served_spec_type(config: dict, drafter_dir: Path) -> str:
    """llama.cpp's speculative type for this drafter (`draft-dspark` for a DSpark one, else `draft-dflash`); a DSpark
    Markov head llama.cpp cannot run (gated, rnn: its graph has the vanilla bias only) is refused before any
    work, not converted into a file that would be misread."""
    from flashdraft.model.dspark import ENGINE_HEAD_TYPES
    from flashdraft.model.export import DSPARK_READS

    if config.get("architectures", [None])[0] not in DSPARK_READS:
        return "draft-dflash"
    head = config.get("markov_head_type", "vanilla")
    if config.get("markov_rank") and head not in ENGINE_HEAD_TYPES:
        raise BadInput(f"{drafter_dir} has a {head} Markov head; llama.cpp (and vLLM) serve vanilla only: train "
                       "with train.markov_head: vanilla to serve it there")
    return "draft-dspark"

"""The public benchmark sets eval measures τ on, by name (standard_sets.yaml: where each lives, its fields, its
turns): read by eval (evaluate/sets.py formats them) and by estimate (how many turns a prompt decodes), so neither
reaches into the other.

    split_source("mt-bench=/data/mt.jsonl") == ("mt-bench", "/data/mt.jsonl")
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml


@functools.cache  # read once a process: a packaged file
def standard_sets() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(resources.files("flashdraft").joinpath("standard_sets.yaml").read_text("utf-8"))


def split_source(source: str) -> tuple[str | None, str | None]:
    """(standard set name, local path or None) for a standard-set source; (None, None) for any other."""
    name, sep, path = source.partition("=")
    if name in standard_sets():
        return name, (path if sep else None)
    return None, None


def turns_per_prompt(source: str) -> int:
    """Turns eval decodes a prompt of `source`: a standard set's own count (mt-bench asks two), else one."""
    name, _ = split_source(source)
    return 2 if name is not None and "turns" in standard_sets()[name] else 1

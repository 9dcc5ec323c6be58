"""Which package a frame's file belongs to, told by the package's location on disk, never by a string in its path:
a checkout named `flashdraft` (git clone's default) holds the package at …/flashdraft/flashdraft/ and its
virtualenv's torch at …/flashdraft/.venv/…, and a path may hold a space."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import flashdraft


def package_dir(module) -> str:
    """The directory a package's `__init__.py` lives in, links resolved."""
    return os.path.realpath(Path(module.__file__).parent)


FLASHDRAFT = package_dir(flashdraft)


@lru_cache(maxsize=4096)  # called on every counted tensor read: one realpath a file
def inside(filename: str, package: str = FLASHDRAFT) -> str | None:
    """`filename` relative to `package` (with '/'), or None where the file is not the package's own."""
    path = os.path.realpath(filename)
    if not path.startswith(package + os.sep):
        return None
    return Path(os.path.relpath(path, package)).as_posix()

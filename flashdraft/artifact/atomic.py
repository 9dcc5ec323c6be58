"""Atomic writes: a crash at any moment leaves the old file (or directory) or the new one, never a half-written
one under a name a later step would trust.

    with atomic_open(path) as f: ...        # temp sibling, fsync, rename, fsync the directory
    with commit_dir(final, "drafter") as tmp: ...   # (flashdraft.artifact.manifest) a whole artifact at once
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Names flashdraft uses for its own bookkeeping (temp files, in-progress markers). Never data, never listed.
INTERNAL_PREFIX = ".flashdraft-"



def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: Path) -> Path:
    """A unique sibling name for `path` that verify and listings ignore."""
    return path.with_name(f"{INTERNAL_PREFIX}tmp-{os.getpid()}-{secrets.token_hex(4)}-{path.name}")


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", **kwargs: Any) -> Iterator[Any]:
    """Open a temp sibling of `path`; on success fsync it and rename it over `path`.

    On any exception (or if the process dies) `path` is untouched and the temp file is removed
    (or, after SIGKILL, left under an internal name that nothing reads).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    f = open(tmp, mode, **kwargs)  # closed on both paths below
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _umask()  # read once, at import: os.umask can only be read by setting it


def honour_umask(directory: Path) -> None:
    """Give every file under `directory` the mode a plain `open` would (some writers, such as safetensors,
    create files readable by their owner only, which a shared model directory cannot serve)."""
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~UMASK)

"""Atomic writes: a crash at any moment leaves the old file (or directory) or the new one, never a half-written
one under a name a later step would trust.

    with atomic_open(path) as f: ...        # temp sibling, fsync, rename, fsync the directory
    with commit_dir(final, "drafter") as tmp: ...   # (flashdraft.artifact.ownership) a whole artifact at once
"""

from __future__ import annotations

import os
import re
import secrets
import socket
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


def writer_tag() -> str:
    """host.pid.random: unique across processes and hosts sharing a disk, and says who wrote a leftover."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"
    return f"{host}.{os.getpid()}.{secrets.token_hex(4)}"


def temp_path_for(path: Path) -> Path:
    """A unique sibling name for `path` that verify and listings ignore: `.flashdraft-tmp-NAME.host.pid.random`."""
    return path.with_name(f"{INTERNAL_PREFIX}tmp-{path.name}.{writer_tag()}")


def leftover_temps(path: Path) -> list[Path]:
    """Temp siblings `temp_path_for(path)` made that a killed writer left behind (exactly this name's)."""
    prefix = f"{INTERNAL_PREFIX}tmp-{path.name}."
    tag = re.compile(r"[A-Za-z0-9_-]+\.\d+\.[0-9a-f]{8}")
    if not path.parent.is_dir():
        return []
    return [path.parent / name for name in os.listdir(path.parent)
            if name.startswith(prefix) and tag.fullmatch(name[len(prefix):])]


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


def write_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, with a write the disk refuses (full, read-only) reported as the one-line
    expected failure it is, not a SafetensorError traceback. Callers write into a temp directory (commit_dir)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from flashdraft.errors import WriteRefused

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        raise WriteRefused(f"cannot write {path}: {e}") from None

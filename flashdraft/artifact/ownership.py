"""Who may write an output: the one rule every stage follows before it writes or deletes anything (DESIGN §1).

    with hold_output(out, "dataset"):      # lock out for the whole run, refuse it unless it is ours to (re)build
        ...

- **Owned**: a missing or empty directory, or one whose manifest (or in-progress owner marker) is this stage's
  kind, may be (re)built. Anything else — a user's directory, another stage's artifact — is refused with one line
  naming what is there; nothing is deleted.
- **Deleted**: only files the output's own manifest names, each checked with the manifest path rules and
  resolved inside the output (`remove_inside`); never a path a manifest entry points elsewhere.
- **Locked**: an advisory `flock` on a sibling lock file for as long as the stage runs. A second run on the same
  output exits at once naming the holder (program, host, pid); a dead holder's lock is released by the kernel, so
  a stale lock file is simply taken over. Locks are per process and re-entrant (a stage that holds its output may
  commit it through `commit_dir`, which takes the same lock).

`fcntl.flock` rather than the `filelock` package: the lock file must carry its holder's name for the refusal, and
be removed safely on release (the inode check below); filelock truncates the file when it opens it. flock works
across hosts on NFSv4 (Linux maps it to POSIX locks there).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flashdraft.artifact.atomic import (
    INTERNAL_PREFIX,
    atomic_write_text,
    honour_umask,
    leftover_temps,
    temp_path_for,
)
from flashdraft.artifact.manifest import (
    MANIFEST,
    Kind,
    Lineage,
    ManifestError,
    commit,
    list_data_files,
    read_manifest,
    unsafe_path_reason,
)
from flashdraft.bounded import read_small
from flashdraft.errors import ExpectedFailure

OWNER = f"{INTERNAL_PREFIX}owner.json"  # inside an output a run has claimed but not yet committed: {"kind", …}


class OutputNotOwned(ExpectedFailure):
    """The output directory holds something this stage did not write: it is refused, nothing is deleted."""


class OutputLocked(ExpectedFailure):
    """Another run holds the output: two writers would leave a mix of both."""


# ---------------------------------------------------------------------------------------------- ownership


def visible_entries(out: Path) -> list[str]:
    """What a user put in `out`: every top-level name but flashdraft's own bookkeeping (sorted)."""
    return sorted(name for name in os.listdir(out) if not name.startswith(INTERNAL_PREFIX))


def owner_kind(out: Path) -> str | None:
    """The kind of flashdraft output `out` is: its manifest's kind, else its owner marker's, else None."""
    for name in (MANIFEST, OWNER):
        try:
            kind = json.loads((out / name).read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(kind, str):
            return kind
    return None


def claim_output(out: str | Path, kind: str, *, mark: bool = False, strays_ok: bool = False, **marker: Any) -> None:
    """Refuse `out` unless this stage may (re)build it: missing, empty, or already of this `kind` with nothing
    its manifest does not list (`strays_ok`: the caller was told to remove such files, e.g. `pull --delete`).
    With `mark`, record the claim in an owner marker (for outputs filled over time, such as generate's batches
    or train's checkpoints), so a rerun after a crash knows the partial files are its own; `marker` adds fields
    to it."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise OutputNotOwned(f"{out} is a link to nothing ({os.readlink(out)}); remove it or use another --out")
    if out.exists() and not out.is_dir():
        raise OutputNotOwned(f"{out} is a file, not an output directory; use another --out")
    if out.is_dir():
        found = owner_kind(out)
        if found is None and (entries := visible_entries(out)):
            shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
            raise OutputNotOwned(f"{out} is not empty and is not a flashdraft {kind} output (it holds {shown}); "
                                 "nothing was changed: use another --out, or an empty directory")
        if found is not None and found != kind:
            raise OutputNotOwned(f"{out} holds a {found} artifact, not a {kind} one; nothing was changed: use "
                                 "another --out")
        if found == kind and not strays_ok and (out / MANIFEST).is_file() and (strays := unlisted_files(out)):
            raise OutputNotOwned(f"{out} is a {kind} artifact but also holds {strays[0]}"
                                 + (f" and {len(strays) - 1} more" if len(strays) > 1 else "")
                                 + ", which its manifest does not list (someone else's?); nothing was changed: "
                                 "move them away, or use another --out")
    if mark:
        mark_output(out, kind, **marker)


def refuse_overlap(out: str | Path, inputs: Iterable[str | Path | None]) -> None:
    """Refuse an `out` that lies inside one of the stage's input directories (or holds one): building there would
    add files its manifest does not list, and the input would stop verifying. Compared by real path, so a link
    does not hide it."""
    real_out = Path(os.path.realpath(out))
    for given in inputs:
        if given is None or not Path(given).is_dir():
            continue
        real_in = Path(os.path.realpath(given))
        if real_out.is_relative_to(real_in) or real_in.is_relative_to(real_out):
            where = "is" if real_out == real_in else ("is inside" if real_out.is_relative_to(real_in) else "holds")
            raise OutputNotOwned(f"--out {out} {where} the input {given}; writing there would change the input "
                                 "(it would no longer verify): nothing was changed, use an --out outside it")


def now_iso() -> str:
    """Now, as markers and lock records state it (UTC, to the second)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def mark_output(out: Path, kind: str, **marker: Any) -> None:
    """Record in `out` that a run of `kind` owns it (what `claim_output` and `owner_kind` read back)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / OWNER, json.dumps({"kind": kind, **marker}))


def adopt(out: Path, kind: str, *, made_before_markers: bool, **marker: Any) -> None:
    """Mark an output flashdraft made before it wrote owner markers (its own layout says so) as `kind`'s."""
    if made_before_markers and out.is_dir() and owner_kind(out) is None:
        mark_output(out, kind, adopted=True, **marker)


def read_marker(out: Path) -> dict[str, Any]:
    try:
        data = json.loads((out / OWNER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remove_inside(out: Path, rel: str) -> bool:
    """Delete the file `rel` names under `out`, only if it is a safe manifest path that resolves inside `out`.
    Returns whether a file was removed."""
    if unsafe_path_reason(rel) is not None:
        return False
    path = out / rel
    if not path.parent.resolve().is_relative_to(out.resolve()):  # a directory on the way links elsewhere
        return False
    if path.is_symlink() or path.is_file():  # a link itself is removed, never what it points at
        path.unlink()
        return True
    return False


def remove_artifact(out: Path) -> None:
    """Remove a committed artifact of ours: its manifest first (it stops existing), then each file the manifest
    names, then flashdraft's own bookkeeping and the directories left empty. Anything else stays, and then the
    directory stays too (the caller checked there is nothing else: `claim_output` under the lock)."""
    import shutil

    try:
        listed = [entry.path for entry in read_manifest(out).files]
    except ManifestError:
        listed = []
    (out / MANIFEST).unlink(missing_ok=True)
    for rel in listed:
        remove_inside(out, rel)
    for name in os.listdir(out):
        if name.startswith(INTERNAL_PREFIX):
            path = out / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
    for dirpath, _, _ in sorted(os.walk(out), key=lambda item: -len(item[0])):  # deepest first
        if not os.listdir(dirpath):
            os.rmdir(dirpath)


def unlisted_files(out: Path) -> list[str]:
    """Data files under a committed artifact that its manifest does not name (a user's, kept on a rebuild)."""
    try:
        listed = {entry.path for entry in read_manifest(out).files}
    except ManifestError:
        return list_data_files(out)
    return [rel for rel in list_data_files(out) if rel not in listed]


# ---------------------------------------------------------------------------------------------- locks


_held: dict[str, tuple[int, int]] = {}  # lock path -> (fd, depth): re-entrant within one process
_held_guard = threading.Lock()


def lock_path(out: Path) -> Path:
    """The lock file: a sibling of the output, so it survives the output being replaced by a rename. Keyed by the
    output's real path, so `--out link` and `--out target` are one output with one lock."""
    out = Path(os.path.realpath(out))
    return out.with_name(f"{INTERNAL_PREFIX}lock-{out.name}")


def holder() -> dict[str, Any]:
    """Who holds a lock, as the refusal names it: the program (and flashdraft's sub-command), host and pid. Never
    the command line: it may carry a password (`--base-url https://user:pw@…`), and the lock file outlives no
    run but is readable while it runs."""
    program = Path(sys.argv[0])
    ours = program.name == "flashdraft" or program.parent.name == "flashdraft"  # the script, or -m / torchrun -m
    sub = next((a for a in sys.argv[1:] if not a.startswith("-")), "") if ours else ""
    if ours:
        name = f"flashdraft {sub}" if sub.isidentifier() else "flashdraft"
    else:  # a script, or `python -c` (argv[0] is "-c")
        name = program.name if program.name not in ("", "-c") else Path(sys.executable).name
    return {"program": name, "host": socket.gethostname(), "pid": os.getpid(), "since": now_iso()}


def _describe_holder(path: Path, wait_s: float = 2.0) -> str:
    """The holder as its lock file names it. A holder writes its name just after it takes the lock, so a
    refusal in that instant waits briefly for the name instead of reporting an anonymous holder."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = read_holder(path)
            return f"{info['program']} (pid {info['pid']} on {info['host']}, since {info['since']})"
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                return "another process (it has not said which yet)"
            time.sleep(0.02)


def read_holder(path: Path) -> dict[str, Any]:
    """The lock file's holder record, read without following a link at its name."""
    return json.loads(read_small(path, 4096, follow_links=False))


def _open_lock_file(path: Path) -> int:
    """Open (creating it exclusively, 0600, when absent) the lock file at `path` without following a link there:
    a link or a hard-linked file planted at the lock path would make the holder record overwrite someone else's
    file. A stale lock file of ours (a killed run's) is a plain file with one link, and is reused."""
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:  # removed by its holder between the two opens: create it again
            continue
        except OSError as e:  # ELOOP: a symbolic link sits at the lock path; EISDIR: a directory does
            what = "a link" if e.errno == errno.ELOOP else e.strerror
            raise OutputLocked(f"{path} is {what}, not a flashdraft lock file; nothing was changed: remove it, "
                               "or use another --out") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise OutputLocked(f"{path} is not a flashdraft lock file (a special file, or a file with another "
                               "name linked to it); nothing was changed: remove it, or use another --out")
        return fd


def lock_holder(out: str | Path) -> dict[str, Any] | None:
    """Who holds `out`'s lock now (its holder record; {} if it has not written one yet), or None when no live
    process does — a killed run's lock file is no holder. Only reads: the file is neither created nor changed."""
    path = lock_path(Path(out))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO planted there must not block
    except OSError:  # none there (never started, or finished), or not a lock file
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held
            try:
                record = json.loads(os.pread(fd, 4096, 0))
            except ValueError:
                record = {}
            return record if isinstance(record, dict) else {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextmanager
def output_lock(out: str | Path, wait: bool = False) -> Iterator[None]:
    """Hold the advisory lock of `out` for the block; raise OutputLocked at once if another process holds it, or
    with `wait`, block until it is released (a shared cache entry: the second process then finds it done)."""
    path = lock_path(Path(out))
    key = str(path)
    with _held_guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
            reentered = True
        else:
            reentered = False
    if not reentered:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputLocked(f"{out} is in use by {_describe_holder(path)}; wait for it to finish, or use "
                                   "another --out") from None
            # The file may have been removed (and recreated) by the holder we waited behind: lock the one on disk.
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)  # a killed holder's record goes: the lock file names only the live holder
        os.write(fd, json.dumps(holder()).encode())
        with _held_guard:
            _held[key] = (fd, 1)
    try:
        yield
    finally:
        with _held_guard:
            fd, depth = _held[key]
            if depth > 1:
                _held[key] = (fd, depth - 1)
            else:
                del _held[key]
                path.unlink(missing_ok=True)  # while still locked: a waiter's inode check sees it is gone
                os.close(fd)


@contextmanager
def hold_output(out: str | Path, kind: str, *, inputs: Iterable[str | Path | None] = (),
                **claim: Any) -> Iterator[None]:
    """A stage's whole run over its output: locked, and refused unless it is this stage's to (re)build and lies
    outside every input directory."""
    refuse_overlap(out, inputs)
    with output_lock(out):
        claim_output(out, kind, **claim)
        yield


@contextmanager
def commit_dir(
    final: str | Path, kind: Kind, *, stats: dict[str, Any] | None = None, lineage: Lineage | None = None
) -> Iterator[Path]:
    """Build a whole artifact in a temp sibling directory; when the block succeeds, describe it in a manifest
    and rename it over `final` in one step. A crash leaves the old artifact or nothing, never a mix. `stats`
    is read after the block, so the block may fill it in.

    `final` must be ours (`claim_output`: missing, empty, or a `kind` artifact holding nothing its
    manifest does not list) and is locked meanwhile; the old artifact is removed file by file as its manifest
    names them, never by deleting whatever the directory holds."""
    final = Path(final)
    with output_lock(final):
        claim_output(final, kind)
        for stale in leftover_temps(final):  # under the lock: a killed writer's, never a live one's
            shutil.rmtree(stale, ignore_errors=True)
        tmp = temp_path_for(final)
        tmp.mkdir(parents=True)
        try:
            yield tmp
            honour_umask(tmp)
            commit(tmp, kind, stats=stats, lineage=lineage)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.is_symlink():  # a link to an artifact kept elsewhere: replace the link, leave what it points at
            final.unlink()
        elif final.exists():
            remove_artifact(final)
        os.replace(tmp, final)

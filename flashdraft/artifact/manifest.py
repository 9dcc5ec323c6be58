"""Artifacts: a directory of data files plus `manifest.json`, written last (DESIGN §1).

    flashdraft manifest DIR        # describe an existing directory of files
    flashdraft verify DIR [--json] # every listed file present with its size and sha256, nothing extra

The manifest is the commit marker: no manifest, no artifact. Every file flashdraft writes goes through
`atomic_open` (temp name, fsync, rename, fsync the directory), so a crash at any moment leaves the old file
or the new one, never a half-written file under a name a later step would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Literal, get_args

from awscrt.checksums import crc64nvme
from pydantic import BaseModel, ConfigDict, ValidationError

from flashdraft import __version__
from flashdraft.artifact.atomic import INTERNAL_PREFIX, atomic_write_text
from flashdraft.errors import BadInput, ExpectedFailure

MANIFEST = "manifest.json"
HASH_CHUNK = 8 << 20  # bytes read at a time: memory per hashing thread stays at one chunk

Kind = Literal["completions", "dataset", "checkpoint", "drafter", "eval", "files", "model", "features"]
KINDS: tuple[str, ...] = get_args(Kind)


# ---------------------------------------------------------------------------------------------- hashing


@dataclass(frozen=True)
class Digest:
    sha256: str  # hex; the identity of the content
    crc64nvme: str  # hex; the full-object checksum S3-compatible stores validate on multipart uploads


class StreamingDigest:
    """SHA-256 and CRC64NVME over bytes fed in order (one pass: CRC64NVME costs ~3 % of SHA-256)."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._crc = 0

    def update(self, chunk: bytes) -> None:
        self._sha.update(chunk)
        self._crc = crc64nvme(chunk, self._crc)

    def digest(self) -> Digest:
        return Digest(self._sha.hexdigest(), f"{self._crc:016x}")


def digest_file(path: str | Path) -> Digest:
    """Stream a file through SHA-256 and CRC64NVME in bounded memory."""
    digest = StreamingDigest()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.digest()


def sha256_file(path: str | Path) -> str:
    return digest_file(path).sha256


def digest_files(paths: Iterable[Path], jobs: int | None = None) -> list[Digest]:
    """Hash many files on all cores. Threads suffice: hashlib and awscrt release the GIL on large buffers."""
    paths = list(paths)
    jobs = jobs or os.cpu_count() or 1
    if len(paths) <= 1 or jobs == 1:
        return [digest_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(jobs, len(paths))) as pool:
        return list(pool.map(digest_file, paths))


def sha256_json(obj: Any) -> str:
    """Digest of a JSON-able value in canonical form (sorted keys, no whitespace): used for config digests."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------- manifest


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str  # POSIX path relative to the artifact root
    size: int
    sha256: str
    crc64nvme: str | None = None  # lets an object store confirm a multipart upload server-side


class Lineage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    inputs: list[str] = []  # sha256 of each input artifact's manifest.json
    config: str = ""  # sha256 of the stage config (canonical JSON)
    flashdraft: str = __version__

    def same_work(self, other: Lineage) -> bool:
        """Same inputs and same config. The flashdraft version is provenance, not a reason to rebuild."""
        return self.inputs == other.inputs and self.config == other.config


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal[1] = 1
    kind: Kind
    files: list[FileEntry]
    stats: dict[str, Any] = {}
    lineage: Lineage = Lineage()
    created: str

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=1) + "\n"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class ManifestError(ExpectedFailure):
    """manifest.json is missing or cannot be read as a flashdraft manifest."""


def is_internal(relpath: str) -> bool:
    return any(part.startswith(INTERNAL_PREFIX) for part in PurePosixPath(relpath).parts)


def unsafe_path_reason(relpath: str) -> str | None:
    """Why `relpath` cannot name a file of an artifact (None if it can): the one path rule that `manifest`, `sync`
    (both ways) and `verify` share, so what one accepts every other accepts. A path is POSIX, relative and
    already normal — segments separated by single slashes, none empty, `.` or `..` — so one file has one name
    (`a//b` and `a/b` would verify as two files that are one); and it holds no backslash, colon or control
    character, which other systems read as separators, drive letters or forged output lines."""
    if not relpath:
        return "empty path"
    if relpath.startswith("/"):
        return "absolute path"
    if any(part in ("", ".", "..") for part in relpath.split("/")):
        return "not a normal relative path (an empty, . or .. segment)"
    if bad := sorted({c for c in relpath if c in "\\:" or not c.isprintable()}):
        names = {"\\": "a backslash", ":": "a colon"}
        return "a character other systems read as part of a path or a line: " + ", ".join(
            names.get(c, repr(c)) for c in bad)
    if relpath == MANIFEST or is_internal(relpath):
        return "reserved name"
    return None


def shown(relpath: str) -> str:
    """A path as it is safe to print: as it is, or quoted with escapes when it holds a control character (a
    newline in a file name would otherwise print a line that looks like flashdraft's own)."""
    return relpath if relpath.isprintable() else repr(relpath)


def list_data_files(root: Path) -> list[str]:
    """Every data file under `root` as sorted POSIX relative paths (manifest and internal files excluded). A link
    to a directory is listed as an entry of its own (never followed), so describing or verifying refuses it
    rather than leaving its files out without a word."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(INTERNAL_PREFIX))
        linked = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in [*filenames, *linked]:
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if rel != MANIFEST and not is_internal(rel):
                found.append(rel)
    return sorted(found)


def refuse_unportable(root: Path, rel: str) -> None:
    """A file that could never verify elsewhere is refused before it is described: a name the path rule refuses
    (`unsafe_path_reason`: `pull` and `verify` would refuse it) or a link that leads outside the artifact."""
    if reason := unsafe_path_reason(rel):
        raise BadInput(f"{shown(str(root / rel))}: {reason}; rename it (pull and verify would refuse it)")
    path = root / rel
    if path.is_symlink() and path.is_dir():
        raise BadInput(f"{path} links to a directory ({path.resolve()}); an artifact holds files: copy them in")
    if path.is_symlink() and not path.resolve().is_relative_to(root.resolve()):
        raise BadInput(f"{path} links outside the artifact (to {path.resolve()}); copy the file in instead")


def build_manifest(
    root: str | Path,
    kind: Kind = "files",
    stats: dict[str, Any] | None = None,
    lineage: Lineage | None = None,
    jobs: int | None = None,
) -> Manifest:
    """Describe every data file under `root` (hashing on all cores)."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root} is not a directory")
    rels = list_data_files(root)
    for rel in rels:
        refuse_unportable(root, rel)
    paths = [root / r for r in rels]
    sizes = [p.stat().st_size for p in paths]
    digests = digest_files(paths, jobs)
    files = [
        FileEntry(path=r, size=s, sha256=d.sha256, crc64nvme=d.crc64nvme)
        for r, s, d in zip(rels, sizes, digests, strict=True)
    ]
    return Manifest(
        kind=kind,
        files=files,
        stats=stats or {},
        lineage=lineage or Lineage(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def describe_directory(root: str | Path, kind: Kind = "files") -> Manifest:
    """A manifest for a directory flashdraft did not build (`flashdraft manifest`, or a plain directory pushed).
    Its lineage is its own: the content digest of its files when it was first described, kept when it is
    re-described after an edit. So a re-push of the same directory replaces its earlier version at a prefix, and
    another user's directory — another identity — is another artifact, refused there without `--force`."""
    root = Path(root)
    built = build_manifest(root, kind=kind)
    try:
        earlier = read_manifest(root)
    except ManifestError:
        earlier = None
    if earlier is not None and earlier.kind == kind:  # the same directory, described again: the same identity
        return built.model_copy(update={"lineage": earlier.lineage})
    identity = "directory:" + sha256_json([[f.path, f.sha256] for f in built.files])
    return built.model_copy(update={"lineage": Lineage(config=identity)})


def write_manifest(root: str | Path, manifest: Manifest) -> str:
    """Commit the artifact: write manifest.json atomically. Returns the manifest's sha256 (its identity)."""
    text = manifest.to_json()
    atomic_write_text(Path(root) / MANIFEST, text)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def commit(root: str | Path, kind: Kind, *, stats: dict[str, Any] | None = None,
           lineage: Lineage | None = None) -> Manifest:
    """Commit the artifact at `root`: describe every file, write the manifest last, then check what was
    written (every file present at its size, nothing unlisted) so "done, verified" is said of a check."""
    manifest = build_manifest(root, kind=kind, stats=stats, lineage=lineage)
    write_manifest(root, manifest)
    if problems := verify_dir(root, deep=False):
        raise NotVerified(f"{root} changed while it was committed: {problems[0]}")
    return manifest


def parse_manifest(raw: bytes) -> Manifest:
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "top level"
        raise ManifestError(f"unparsable: {where}: {first['msg']}") from None


def read_manifest(root: str | Path) -> Manifest:
    path = Path(root) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError("missing: the artifact was never committed (or was deleted)") from None
    return parse_manifest(raw)


def manifest_digest(root: str | Path) -> str:
    """sha256 of manifest.json's bytes: what a downstream stage records as its input in `lineage.inputs`."""
    return hashlib.sha256((Path(root) / MANIFEST).read_bytes()).hexdigest()


def content_digest(path: str | Path) -> str:
    """A stage input by content: its manifest digest if it is an artifact, else the hash of its file(s)."""
    path = Path(path)
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return manifest_digest(path)
        return sha256_json([[rel, sha256_file(path / rel)] for rel in list_data_files(path)])
    return sha256_file(path)


def identity(ref: str | Path) -> str:
    """A model or drafter in lineage: its manifest digest when it is a committed artifact; else, for a local
    directory (z-lab's drafter, a copy made by hand, a downloaded target), the content of its files — never only its
    name, so weights changed in place are another input; else the reference itself (a hub id)."""
    path = Path(ref)
    if (path / MANIFEST).is_file():
        return manifest_digest(path)
    if path.is_dir():
        files = list_data_files(path)
        return "content:" + sha256_json([[rel, remembered_sha256(path / rel)] for rel in files])
    return str(ref)


def remembered_sha256(path: Path) -> str:
    """A file's SHA-256, hashed once per version of the file: remembered in the machine's cache under what its
    status says of it (device, inode, size, modification and change times; the change time cannot be set back by
    hand, so an in-place edit is always a new key). A 54 GB target is hashed on its first use, not on every run."""
    from flashdraft.layout import cache_dir

    st = path.stat()
    key = sha256_json([str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    memo = cache_dir() / "digests" / key
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo, digest)
    except OSError:  # a read-only cache: hashed again next time, nothing worse
        pass
    return digest


# ---------------------------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class Problem:
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{shown(self.path)}: {self.problem}"


def verify_dir(root: str | Path, deep: bool = True, jobs: int | None = None) -> list[Problem]:
    """Check a local artifact against its manifest. Empty list = verified.

    Local files are always re-hashed (`deep`), since a same-size in-place edit keeps the size and a local
    disk has no server-side checksum to trust; `deep=False` checks presence and sizes only.
    """
    root = Path(root)
    try:
        manifest = read_manifest(root)
    except ManifestError as e:
        return [Problem(MANIFEST, str(e))]
    return verify_against(root, manifest, deep, jobs)


def verify_against(root: Path, manifest: Manifest, deep: bool = True, jobs: int | None = None) -> list[Problem]:
    """`verify_dir` against a manifest already read (an input's, parsed once at a stage's edge)."""
    problems: list[Problem] = []
    to_hash: list[tuple[FileEntry, Path]] = []
    for entry in manifest.files:
        if reason := unsafe_path_reason(entry.path):
            problems.append(Problem(entry.path, f"refused manifest entry: {reason}"))
            continue
        path = root / entry.path
        if not path.is_file():
            problems.append(Problem(entry.path, "missing"))
            continue
        size = path.stat().st_size
        if size != entry.size:
            what = "truncated" if size < entry.size else "grown"
            problems.append(Problem(entry.path, f"{what}: size {size}, manifest says {entry.size}"))
        elif deep:
            to_hash.append((entry, path))

    problems += content_problems(root, [entry for entry, _ in to_hash], jobs)

    listed = {e.path for e in manifest.files}
    for rel in list_data_files(root):
        if (root / rel).is_dir():
            problems.append(Problem(rel, "a link to a directory: an artifact holds files, never links to folders"))
        elif rel not in listed:
            problems.append(Problem(rel, "unlisted file: not in the manifest"))
    return problems


def content_problems(root: Path, entries: list[FileEntry], jobs: int | None = None) -> list[Problem]:
    """The files of `entries` under `root` whose bytes no longer match the manifest (re-hashed on all cores)."""
    digests = digest_files((root / e.path for e in entries), jobs)
    return [Problem(e.path, "content differs: sha256 does not match the manifest")
            for e, d in zip(entries, digests, strict=True) if d.sha256 != e.sha256]


class NotVerified(ExpectedFailure):
    """An input artifact whose files no longer match its manifest: a stage refuses to use it. `problems`: what
    did not match (the first is in the message), for a caller that passes over the artifact instead."""

    problems: list[Problem] = []


def require_verified(root: str | Path, what: str, remedy: str) -> Manifest:
    """A stage's input as it is now: its manifest if every file verifies (re-hashed), else NotVerified naming
    the first file that does not and saying what to do."""
    if problems := verify_dir(root):
        raise not_verified(what, root, problems, remedy)
    return read_manifest(root)


def not_verified(what: str, root: str | Path, problems: list[Problem], remedy: str) -> NotVerified:
    """The one line for an input that does not verify: the first problem, how many more, what to do."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    error = NotVerified(f"{what} {root} does not verify: {problems[0]}{more}; {remedy}")
    error.problems = problems
    return error


# ---------------------------------------------------------------------------------------------- skip logic


@dataclass(frozen=True)
class Decision:
    """What a stage should do with its output directory, and why (printed as one line)."""

    done: bool
    reason: str

    def line(self, stage: str, out: str | Path) -> str:
        if self.done:
            return f"{stage}: already done, verified — {out} ({self.reason})"
        return f"{stage}: building {out} ({self.reason})"


def check_done(out: str | Path, lineage: Lineage, deep: bool = True) -> Decision:
    """The one skip rule every stage uses: done iff the manifest verifies and its lineage matches."""
    out = Path(out)
    if not (out / MANIFEST).exists():
        return Decision(False, "no manifest yet")
    try:
        manifest = read_manifest(out)
    except ManifestError as e:
        return Decision(False, f"manifest {e}")
    if not manifest.lineage.same_work(lineage):
        changed = "inputs" if manifest.lineage.inputs != lineage.inputs else "config"
        return Decision(False, f"lineage differs: {changed} changed since it was built")
    problems = verify_dir(out, deep=deep)
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        return Decision(False, f"does not verify: {problems[0]}{more}")
    return Decision(True, f"{len(manifest.files)} files, {manifest.total_bytes:,} bytes, lineage matches")

"""sync: move an artifact between a local directory and a store — by content, manifest last, verified there.

    flashdraft sync push out/dataset s3://bucket/run1/dataset     # upload what differs, verify, commit
    flashdraft sync pull s3://bucket/run1/dataset out/dataset     # download what differs, verify, commit
    flashdraft verify s3://bucket/run1/dataset [--deep]           # list + head checksums (or re-hash)

A file is sent iff the destination lacks it or holds different content (size + the store's checksum against
the manifest's SHA-256 / CRC64NVME), so a same-size edit is always sent and an identical file never is. While
files change, the destination's manifest is absent: the artifact there does not exist until every file has
been confirmed by the store, and only then is the manifest written (a conditional create on S3).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from flashdraft.artifact.atomic import atomic_write_bytes, atomic_write_text
from flashdraft.artifact.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    ManifestError,
    Problem,
    content_problems,
    describe_directory,
    digest_files,
    list_data_files,
    parse_manifest,
    read_manifest,
    unsafe_path_reason,
    verify_dir,
    write_manifest,
)
from flashdraft.artifact.ownership import OWNER, claim_output, output_lock, read_marker, refuse_overlap
from flashdraft.artifact.prefix import (
    EARLIER,
    LocalLease,
    VerifyFailed,
    WriterLease,
    changed_since,
    claim_prefix,
    listed_by,
    retire_manifest,
)
from flashdraft.artifact.store import (
    DEFAULT_PART_SIZE,
    MIN_PART_SIZE,
    SINGLE_PUT_LIMIT,
    Listed,
    LocalStore,
    Remote,
    StoreError,
)
from flashdraft.layout import cache_dir


@dataclass
class SyncResult:
    direction: str  # push | pull
    src: str
    dst: str
    transferred: int = 0
    bytes_transferred: int = 0
    skipped: int = 0
    deleted: int = 0
    verified: int = 0
    already_done: bool = False

    def line(self) -> str:
        moved = "uploaded" if self.direction == "push" else "downloaded"
        if self.already_done:
            return f"{self.direction}: {self.dst} already done, verified ({self.verified} files, nothing {moved})"
        deleted = f", deleted {self.deleted}" if self.deleted else ""
        return (
            f"{self.direction}: {self.dst} — {moved} {self.transferred} ({self.bytes_transferred:,} bytes), "
            f"already present {self.skipped}{deleted}, verified {self.verified}"
        )

    def to_json(self) -> dict:
        moved = "uploaded" if self.direction == "push" else "downloaded"
        return {
            "ok": True,
            moved: self.transferred,
            f"bytes_{moved}": self.bytes_transferred,
            "skipped": self.skipped,
            "deleted": self.deleted,
            "verified": self.verified,
            "already_done": self.already_done,
        }


# ---------------------------------------------------------------------------------------------- helpers


@contextmanager
def transfer_progress(console: Console | None, total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A bytes + bytes/s progress bar (on a terminal); yields a thread-safe `advance(nbytes)`."""
    if console is None or total == 0:
        yield lambda n: None
        return
    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _parallel(fn: Callable, items: list, jobs: int) -> list:
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(items)))) as pool:
        return list(pool.map(fn, items))


def _transfer_all(fn: Callable[[FileEntry], None], entries: list[FileEntry], jobs: int) -> None:
    """Run every transfer; afterwards raise one error naming each file that failed."""

    def attempt(entry: FileEntry) -> str | None:
        try:
            fn(entry)
        except (StoreError, OSError) as e:
            return f"{entry.path}: {e}"
        return None

    failures = [f for f in _parallel(attempt, entries, jobs) if f]
    if failures:
        raise StoreError(f"{len(failures)} transfer(s) failed: " + "; ".join(failures[:5]))


def local_manifest(src: Path, log: Callable[[str], None], deep: bool = True) -> tuple[Manifest, bytes]:
    """SRC's manifest as bytes, after checking SRC against it (every byte re-hashed, on all cores).

    A plain directory (kind `files`: no manifest yet, or one built by `manifest`/`sync`) is re-described when
    its files changed, so a same-size edit is sent; a stage's artifact that no longer verifies is refused.
    `deep=False` checks a stage artifact's files for presence and size only (the caller hashes the rest);
    a plain directory is always re-hashed, since that is how its changes are found.
    """
    if not src.is_dir():
        raise StoreError(f"{src} is not a directory")
    try:
        kind = read_manifest(src).kind if (src / MANIFEST).exists() else "files"
    except ManifestError:
        kind = "files"
    if not (src / MANIFEST).exists():
        built = describe_directory(src)
        log(f"notice: {src} had no manifest.json; {_keep_description(src, built)} ({len(built.files)} files)")
    elif problems := verify_dir(src, deep=deep or kind == "files"):
        if kind != "files":
            raise VerifyFailed(str(src), problems)
        built = describe_directory(src)
        log(f"notice: {src} changed since its manifest ({problems[0]}…); {_keep_description(src, built)} "
            f"({len(built.files)} files)")
    else:
        raw = (src / MANIFEST).read_bytes()
        return parse_manifest(raw), raw
    raw = built.to_json().encode("utf-8")
    return built, raw


def _keep_description(src: Path, built: Manifest) -> str:
    """Keep a plain directory's new description beside its files (its identity across later edits), where the
    directory can be written; a read-only source (an NFS export, a colleague's directory) is pushed from the
    description in memory, and nothing is written into it."""
    try:
        write_manifest(src, built)
    except OSError as e:
        return f"described it in memory ({e.strerror or e}: nothing is written into the source)"
    return "built one"


NO_CHECKSUM = "the store returned no checksum for it"


def check_objects(
    store, manifest: Manifest, jobs: int, known: dict[str, Remote] | None = None, confirmed: dict | None = None
) -> list[Problem]:
    """Destination check: list (nothing missing, nothing extra) and the store's checksum of every object.

    `known` holds heads taken moments ago in this run (objects not re-sent), so each object is asked once.
    `confirmed` (out) receives the listing entry of every object whose checksum was looked at.
    """
    confirmed = {} if confirmed is None else confirmed
    listing = store.list()
    known = known or {}
    listed = {e.path for e in manifest.files}
    to_head = [e.path for e in manifest.files if e.path in listing and e.path not in known]
    heads = dict(known) | dict(zip(to_head, _parallel(store.head, to_head, jobs), strict=True))
    confirmed.update({rel: listing[rel] for rel, h in heads.items() if rel in listing and h is not None})
    problems = []
    for entry in manifest.files:
        remote = heads.get(entry.path)
        if entry.path not in listing or remote is None:
            problems.append(Problem(entry.path, "missing at the destination"))
        elif remote.size != entry.size:
            problems.append(Problem(entry.path, f"size {remote.size}, manifest says {entry.size}"))
        elif remote.sha256 is None and remote.crc64nvme is None:
            problems.append(Problem(entry.path, f"{NO_CHECKSUM}, so its content cannot be confirmed (`verify --deep` "
                                                "re-hashes the bytes)"))
        elif not remote.matches(entry):
            problems.append(Problem(entry.path, "content differs: the store's checksum does not match the manifest"))
    for rel in sorted(listing):
        if rel != MANIFEST and rel not in listed:
            problems.append(Problem(rel, "unlisted object: not in the manifest (push with --delete to remove it)"))
    return problems


# ---------------------------------------------------------------------------------------------- push


def push(
    src: Path,
    store,
    *,
    delete: bool = False,
    jobs: int = 8,
    part_size: int | None = None,
    force: bool = False,
    console: Console | None = None,
    log: Callable[[str], None] = print,
    lease: WriterLease | None = None,
) -> SyncResult:
    """Push the artifact at `src` to `store`. Refused before anything is written when the prefix holds an
    artifact of another kind or lineage (unless `force`), or objects no manifest of this artifact listed (with or
    without `force`: `--delete` removes only what a replaced manifest of this prefix listed).
    `part_size`: files larger than this go in parts of this size; None chooses (`upload_part_size`).

    Two writers at once: a local destination is locked for the push; on S3 every object is written only over the
    version this push saw at its start (a conditional write: If-None-Match for a new object, If-Match its ETag
    for a replaced one) and only while the prefix has no manifest (looked at before each write), and after its
    own commit the push confirms that every object is the one it sent or kept. So of two concurrent pushes at
    most one ends "verified", and a push that said "verified" is not overwritten by the other afterwards.
    `lease`: a writer lease the caller already holds on `store` (generate, which uploads batches under it before
    this final push); otherwise the push takes its own."""
    if getattr(store, "prefix", None) == "":
        raise StoreError(f"refusing to push to the bucket root {store.url}: name a prefix (e.g. {store.url}/run1/data)")
    described_here = Path(src).is_dir() and not (Path(src) / MANIFEST).exists()
    try:
        if isinstance(store, LocalStore):
            refuse_overlap(store.root, [src])
            with output_lock(store.root):
                return _push(Path(src), store, delete, jobs, part_size, force, console, log, lease)
        return _push(Path(src), store, delete, jobs, part_size, force, console, log, lease)
    except BaseException:
        if described_here and _kind_at(Path(src)) == "files":  # the description this push wrote, nothing else
            (Path(src) / MANIFEST).unlink(missing_ok=True)  # left as it was found, without a manifest
        raise


def _kind_at(root: Path) -> str | None:
    try:
        return read_manifest(root).kind
    except ManifestError:
        return None


def _push(src: Path, store, delete: bool, jobs: int, part_size: int | None, force: bool, console,
          log: Callable[[str], None], held: WriterLease | None = None) -> SyncResult:
    # A stage artifact's bytes are checked once: the files that will not be sent are re-hashed here (below), the
    # ones that will are checked by the store against the manifest's checksums as they arrive.
    manifest, raw = local_manifest(src, log, deep=False)
    result = SyncResult("push", str(src), store.url)
    listing = store.list()  # what this push saw at its start: every write below is conditional on it
    listed = {e.path for e in manifest.files}
    memo = EtagMemo(src, store.url)

    # What the destination already holds, by content: the store's checksum of every object whose size
    # matches, or, for an object this machine confirmed before, its unchanged ETag in the listing.
    same_size = [e for e in manifest.files if e.path in listing and listing[e.path].size == e.size]
    present = {e.path: Remote(e.size, e.sha256) for e in same_size if memo.vouches(e, listing[e.path])}
    to_head = [e.path for e in same_size if e.path not in present]
    present |= {r: h for r, h in zip(to_head, _parallel(store.head, to_head, jobs), strict=True) if h is not None}
    to_send = [e for e in manifest.files if not (e.path in present and present[e.path].matches(e))]
    sending = {e.path for e in to_send}
    kept = [e for e in manifest.files if e.path not in sending]
    if manifest.kind != "files" and (problems := content_problems(src, kept)):
        raise VerifyFailed(str(src), problems)
    extra = [rel for rel in listing if rel != MANIFEST and rel not in listed]
    remote_manifest = claim_prefix(store, manifest.kind, manifest.lineage, force=force, log=log)
    if not (src / MANIFEST).exists() and _same_files(remote_manifest, manifest):
        # a read-only plain directory, described in memory again: the store's description of the same files
        # stands (its creation time with it), so a rerun is the no-op it should be
        manifest, raw = parse_manifest(remote_manifest), remote_manifest

    if not to_send and not extra and remote_manifest == raw:
        memo.save(manifest, {rel: listing[rel] for rel in listed})
        result.already_done, result.skipped, result.verified = True, len(manifest.files), len(manifest.files)
        return result

    # What earlier manifests of this prefix listed: the only objects --delete may remove (with or without --force:
    # replacing an artifact on purpose never deletes what it did not list, such as another artifact stored below).
    # Kept under an internal name while the manifest is absent, so a push killed midway still knows on its rerun.
    # Anything else under the prefix stops the push before it changes anything.
    earlier = listed_by(store.read_bytes(EARLIER)) | listed_by(remote_manifest)
    foreign = [rel for rel in extra if rel not in earlier]
    if foreign or (extra and not delete):
        why = ("unlisted object that no earlier manifest of this prefix listed: not deleted (another artifact's, "
               "or a user's? remove it by hand or push to an empty prefix)")
        raise VerifyFailed(store.url, [Problem(rel, why if rel in foreign else
                                               "unlisted object: not in the manifest (push with --delete to remove it)")
                                       for rel in foreign + [r for r in extra if r not in foreign]])
    lease_held = (nullcontext(held) if held is not None else LocalLease() if isinstance(store, LocalStore)
                  else WriterLease(store, log))
    with lease_held as lease:
        return _write(src, store, manifest, raw, listing, present, to_send, extra, earlier, remote_manifest, memo,
                      result, delete, jobs, part_size, console, log, lease)


def _write(src: Path, store, manifest: Manifest, raw: bytes, listing: dict, present: dict, to_send: list,
           extra: list, earlier: set, remote_manifest: bytes | None, memo: EtagMemo, result: SyncResult,
           delete: bool, jobs: int, part_size: int | None, console, log: Callable[[str], None], lease) -> SyncResult:
    """The writing half of a push, under its writer lease: retire the old manifest, upload (each object only over
    the version seen at the start), delete what --delete may, check, commit, confirm. The manifest read at the start
    is checked once more first (`retire_manifest`): a commit between that read and the lease is not written under."""
    listed = {e.path for e in manifest.files}
    sending = {e.path for e in to_send}
    retire_manifest(store, remote_manifest, earlier, manifest.kind, manifest.lineage)
    if hasattr(store, "abort_incomplete_uploads") and (aborted := store.abort_incomplete_uploads()):
        log(f"push: aborted {aborted} multipart upload(s) at {store.url} left open for over a day (a killed push's)")
    total = sum(e.size for e in to_send)
    part_size = part_size or upload_part_size(to_send, jobs)
    sent: dict[str, str | None] = {}  # path -> the ETag the store gave this push's upload

    def upload(entry: FileEntry) -> None:
        lease.check()
        before = listing.get(entry.path)
        sent[entry.path] = store.upload(src / entry.path, entry, advance, part_size,
                                        if_match=before.etag if before else None, if_absent=before is None)

    with transfer_progress(console, total, "upload") as advance:
        _transfer_all(upload, to_send, jobs)
    if delete:
        for rel in extra:
            lease.check()
            store.delete(rel)
        result.deleted = len(extra)

    confirmed: dict = {}
    known = {k: v for k, v in present.items() if k not in sending}
    problems = check_objects(store, manifest, jobs, known=known, confirmed=confirmed)
    expected = {rel: sent[rel] if rel in sent else listing[rel].etag for rel in listed}
    problems += [Problem(rel, "overwritten by another writer during this push") for rel, item in confirmed.items()
                 if expected.get(rel) and item.etag and item.etag != expected[rel]]
    if problems:
        raise VerifyFailed(store.url, problems)
    lease.renew()  # still ours, just now: no other writer can have started since
    lease.check()
    store.put_manifest(raw)  # a conditional create: a second writer's fails (this push deleted the old one)
    if store.read_bytes(MANIFEST) != raw:
        raise VerifyFailed(store.url, [Problem(MANIFEST, "the committed manifest does not read back identically")])
    if changed := changed_since(store, confirmed):  # another writer overwrote an object while this one committed
        if store.read_bytes(MANIFEST) == raw:
            store.delete(MANIFEST)
        raise VerifyFailed(store.url, [Problem(rel, "overwritten by another writer while this push committed; "
                                                    "the manifest was withdrawn: rerun once it has finished")
                                       for rel in changed])
    store.delete(EARLIER)
    memo.save(manifest, confirmed)

    result.transferred, result.bytes_transferred = len(to_send), total
    result.skipped, result.verified = len(manifest.files) - len(to_send), len(manifest.files)
    return result


def _same_files(raw: bytes | None, manifest: Manifest) -> bool:
    """Whether a store's manifest describes exactly `manifest`'s files as the same kind of artifact."""
    if raw is None:
        return False
    try:
        theirs = parse_manifest(raw)
    except ManifestError:
        return False
    return theirs.kind == manifest.kind and theirs.files == manifest.files and theirs.lineage.same_work(
        manifest.lineage)


def upload_part_size(to_send: list[FileEntry], jobs: int) -> int:
    """With at least `jobs` files of some size to send, the files alone keep every connection busy: each goes
    in one request, streamed from disk (fewest requests; the server checks it against the manifest's checksum).
    With fewer, large files go in parts, so their parts fill the connections. On 1 GB in 12 files this is
    1.4x faster than 64 MB parts and 1.1x faster than 8 MB parts (benchmarks/RESULTS.md, sync)."""
    if sum(e.size > MIN_PART_SIZE for e in to_send) >= jobs:
        return SINGLE_PUT_LIMIT
    return DEFAULT_PART_SIZE


class EtagMemo:
    """ETags of objects whose checksums this machine confirmed against the manifest, per source and store URL.

    A store changes an object's ETag whenever it is overwritten, so an unchanged ETag in a fresh listing
    vouches for content confirmed earlier: a no-op re-sync of 1,000 files costs one listing, not 1,000
    HEADs. Kept in this machine's cache (keyed by the source's real path), never in the source: a push does not
    write into what it copies (a read-only source pushes, and re-pushes, as any other). Losing it costs HEADs,
    not correctness; a cache that cannot be written is skipped.
    """

    def __init__(self, src: Path, url: str) -> None:
        key = hashlib.sha256(os.path.realpath(src).encode()).hexdigest()[:32]
        self.path, self.url = cache_dir() / "push-memo" / f"{key}.json", url
        try:
            self.all = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.all = {}
        self.known: dict = self.all.get(url, {}) if isinstance(self.all, dict) else {}

    def vouches(self, entry: FileEntry, listed: Listed) -> bool:
        seen = self.known.get(entry.path)
        return listed.etag is not None and seen == [listed.etag, entry.sha256]

    def save(self, manifest: Manifest, confirmed: dict[str, Listed]) -> None:
        by_path = {e.path: e for e in manifest.files}
        memo = {
            rel: [item.etag, by_path[rel].sha256] for rel, item in confirmed.items() if item.etag and rel in by_path
        }
        self.all = (self.all if isinstance(self.all, dict) else {}) | {self.url: memo}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(self.all))
        except OSError:  # a read-only home: the next push asks the store instead
            pass


# ---------------------------------------------------------------------------------------------- pull


def remote_manifest(store) -> tuple[Manifest, bytes]:
    raw = store.read_bytes(MANIFEST)
    if raw is None:
        raise StoreError(f"no artifact at {store.url}: {MANIFEST} is missing (never committed, or deleted)")
    try:
        return parse_manifest(raw), raw
    except ManifestError as e:
        raise StoreError(f"{store.url}/{MANIFEST}: {e}") from None


def refuse_unsafe_paths(manifest: Manifest, dst: Path) -> None:
    """A manifest from a store is input: reject any path that would land outside `dst`."""
    root = dst.resolve()
    bad = []
    for entry in manifest.files:
        reason = unsafe_path_reason(entry.path)
        if reason is None and not (root / entry.path).resolve().is_relative_to(root):
            reason = "resolves outside the destination"
        if reason:
            bad.append(f"{entry.path!r} ({reason})")
    if bad:
        raise StoreError(f"refusing to pull: the manifest lists unsafe paths: {', '.join(bad[:5])}")


def pull(
    store,
    dst: Path,
    *,
    delete: bool = False,
    jobs: int = 8,
    console: Console | None = None,
    remote: tuple[Manifest, bytes] | None = None,
) -> SyncResult:
    """The artifact at `store` into `dst`, every file hashed as it lands. `remote`: its manifest as the caller
    already read it (remote_manifest), so that what it checked is what is pulled (not a second read)."""
    dst = Path(dst)
    manifest, raw = remote or remote_manifest(store)
    refuse_unsafe_paths(manifest, dst)
    refuse_overlap(dst, [getattr(store, "root", None)])
    with output_lock(dst):
        # dst must be empty, missing or this kind's (its own files only, unless --delete); marked while files
        # change, with the files its old manifest named (ours to replace), so a killed pull resumes.
        earlier = listed_by((dst / MANIFEST).read_bytes() if (dst / MANIFEST).is_file() else None)
        earlier |= set(read_marker(dst).get("earlier", [])) if dst.is_dir() else set()
        claim_output(dst, manifest.kind, mark=True, strays_ok=delete, earlier=sorted(earlier))
        result = _pull_into(store, dst, manifest, raw, earlier, delete, jobs, console)
        (dst / OWNER).unlink(missing_ok=True)
        return result


def _pull_into(store, dst: Path, manifest: Manifest, raw: bytes, earlier: set[str], delete: bool, jobs: int,
               console) -> SyncResult:
    result = SyncResult("pull", store.url, str(dst))

    # What is here already, by content.
    candidates = [e for e in manifest.files if (dst / e.path).is_file() and (dst / e.path).stat().st_size == e.size]
    digests = digest_files([dst / e.path for e in candidates], jobs)
    present = {e.path for e, d in zip(candidates, digests, strict=True) if d.sha256 == e.sha256}
    to_fetch = [e for e in manifest.files if e.path not in present]
    listed = {e.path for e in manifest.files}
    extra = [rel for rel in list_data_files(dst) if rel not in listed] if dst.is_dir() else []
    local_raw = (dst / MANIFEST).read_bytes() if (dst / MANIFEST).is_file() else None

    if not to_fetch and not extra and local_raw == raw:
        result.already_done, result.skipped, result.verified = True, len(manifest.files), len(manifest.files)
        return result

    if strays := [rel for rel in extra if rel not in earlier and not delete]:  # before anything changes
        raise VerifyFailed(str(dst), [Problem(rel, "unlisted local file that no earlier manifest here named "
                                                   "(pull with --delete to remove it)") for rel in strays])
    if local_raw is not None:
        (dst / MANIFEST).unlink()  # the local copy stops being an artifact while it changes
    total = sum(e.size for e in to_fetch)
    with transfer_progress(console, total, "download") as advance:
        # Each download is hashed as it is written and renamed into place only if it matches.
        _transfer_all(lambda e: store.download(e.path, dst / e.path, e, advance), to_fetch, jobs)
    for rel in extra:  # files of the version this one replaces (or, with --delete, any unlisted file)
        (dst / rel).unlink()
    dst.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(dst / MANIFEST, raw)
    result.transferred, result.bytes_transferred, result.deleted = len(to_fetch), total, len(extra)
    result.skipped, result.verified = len(present), len(manifest.files)
    return result


# ---------------------------------------------------------------------------------------------- verify


def verify_store(store, *, deep: bool = False, jobs: int = 8,
                 remote: tuple[Manifest, bytes] | None = None) -> list[Problem]:
    """Check an artifact where it lives: manifest readable, safe paths, list + checksums (or re-hash). `remote`:
    its manifest as the caller already read it (the objects are checked against that one)."""
    try:
        manifest, _ = remote or remote_manifest(store)
    except StoreError as e:
        return [Problem(MANIFEST, str(e))]
    problems = [
        Problem(e.path, f"refused manifest entry: {r}") for e in manifest.files if (r := unsafe_path_reason(e.path))
    ]
    if problems:
        return problems
    problems = check_objects(store, manifest, jobs)
    if deep:  # the bytes are re-hashed below, so an object without a store checksum is confirmed there
        problems = [p for p in problems if not p.problem.startswith(NO_CHECKSUM)]
    if deep and not problems:
        hashes = _parallel(store.hash_object, [e.path for e in manifest.files], jobs)
        for entry, digest in zip(manifest.files, hashes, strict=True):
            if digest != entry.sha256:
                problems.append(Problem(entry.path, "content differs: re-hashed bytes do not match the manifest"))
    return problems

"""Who may write a store prefix: one push at a time (the writer lease), and only over its own kind and lineage
(the prefix claim); what earlier manifests there listed, so that `--delete` removes only what one of them named.

    with WriterLease(store, log):          # .flashdraft-writer.json, created If-None-Match, renewed If-Match
        remote = claim_prefix(store, kind, lineage)

S3 pushes hold `WriterLease`; a local store's push holds the output's lock instead (`LocalLease` stands in).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from flashdraft.artifact.atomic import INTERNAL_PREFIX
from flashdraft.artifact.manifest import (
    MANIFEST,
    Lineage,
    ManifestError,
    Problem,
    parse_manifest,
    shown,
)
from flashdraft.artifact.store import (
    Listed,
    StoreError,
)
from flashdraft.errors import ExpectedFailure


@dataclass
class VerifyFailed(ExpectedFailure):
    """An artifact in a store that does not verify, or a write there refused: one line of grouped problems."""

    where: str
    problems: list[Problem] = field(default_factory=list)

    def __str__(self) -> str:
        """One line: the problems grouped by what is wrong, each naming up to three of its paths."""
        groups: dict[str, list[str]] = {}
        for p in self.problems:
            groups.setdefault(p.problem, []).append(shown(p.path))
        parts = [", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "") + f": {problem}"
                 for problem, paths in groups.items()]
        return f"{self.where}: " + "; ".join(parts)


class PrefixBusy(ExpectedFailure):
    """Another live push holds the prefix's writer lease: two writers would leave a mix."""


class WriterLease:
    """One writer at a time under an S3 prefix: a small object (`.flashdraft-writer.json`, internal, never listed
    as data) created with If-None-Match, naming its holder, renewed every RENEW_S seconds with If-Match on its own
    ETag, and deleted when the push ends. A second push finds it and stops before writing anything. A lease not
    renewed for LEASE_S seconds (by the store's clock), or held by a dead process on this host, is a killed
    push's and is taken over, so a rerun resumes. A push that loses its lease (renewal refused: it was paused past
    LEASE_S and taken over) writes nothing more. On a local store the directory's lock does this job."""

    NAME = f"{INTERNAL_PREFIX}writer.json"
    LEASE_S, RENEW_S = 120.0, 30.0

    def __init__(self, store, log: Callable[[str], None]) -> None:
        import socket
        import uuid

        self.store, self.log = store, log
        self.record = {"program": "flashdraft sync push", "host": socket.gethostname(), "pid": os.getpid(),
                       "token": uuid.uuid4().hex}
        self.etag: str | None = None
        self.lost = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def __enter__(self) -> WriterLease:
        data = json.dumps(self.record).encode()
        self.etag = self.store.write_if(self.NAME, data)
        if self.etag is None:
            self._take_over(data)
        self.thread = threading.Thread(target=self._renew_loop, daemon=True, name="writer-lease")
        self.thread.start()
        return self

    def _take_over(self, data: bytes) -> None:
        found = self.store.read_with_age(self.NAME)
        if found is None:  # released between the two calls
            self.etag = self.store.write_if(self.NAME, data)
        else:
            raw, etag, age = found
            try:
                holder = json.loads(raw)
            except ValueError:
                holder = {}
            dead_here = holder.get("host") == self.record["host"] and not _alive(holder.get("pid"))
            if not dead_here and age < self.LEASE_S:
                raise PrefixBusy(f"{self.store.url} is being written by {holder.get('program', 'another push')} "
                                 f"(pid {holder.get('pid', '?')} on {holder.get('host', '?')}, renewed {age:.0f} s "
                                 f"ago); nothing was written: wait for it to finish (a dead one's lease lapses "
                                 f"{self.LEASE_S:.0f} s after its last renewal, then rerun)")
            self.etag = self.store.write_if(self.NAME, data, if_match=etag)
            if self.etag is not None:
                self.log(f"push: took over the writer lease of a push that is gone (pid {holder.get('pid', '?')} "
                         f"on {holder.get('host', '?')}, last renewed {age:.0f} s ago)")
        if self.etag is None:
            raise PrefixBusy(f"{self.store.url}: another push took the writer lease at the same moment; nothing "
                             "was written: rerun once it has finished")

    def _renew_loop(self) -> None:
        while not self.stop.wait(self.RENEW_S):
            self.renew()

    def renew(self) -> None:
        with self.lock:
            if self.lost.is_set():
                return
            etag = self.store.write_if(self.NAME, json.dumps(self.record).encode(), if_match=self.etag)
            if etag is None:
                self.lost.set()
            else:
                self.etag = etag

    def check(self) -> None:
        """Before each write: raise if the lease was lost (this push must not write any more)."""
        if self.lost.is_set():
            raise StoreError(f"{self.store.url}: this push lost its writer lease (it was paused past "
                             f"{self.LEASE_S:.0f} s and another push took over); it stopped writing: rerun to see "
                             "what is there now")

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        with self.lock:
            try:
                found = None if self.lost.is_set() else self.store.read_with_age(self.NAME)
                if found is not None and found[1] == self.etag:
                    self.store.delete(self.NAME)
            except StoreError:  # the store went away: the lease lapses by itself; the push's own error matters
                pass


class LocalLease:
    """A local store's writers are kept apart by its directory lock (held by `push`): nothing to do here."""

    def __enter__(self) -> LocalLease:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def check(self) -> None:
        pass

    def renew(self) -> None:
        pass


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return True  # cannot tell: treat as alive, so only the lapse of the lease frees it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


EARLIER = f"{INTERNAL_PREFIX}earlier-files.json"  # in the store: files earlier manifests listed (see push)


class PrefixOwned(ExpectedFailure):
    """The store prefix holds another run's artifact: writing there would replace it."""


def claim_prefix(store, kind: str, lineage: Lineage, *, force: bool = False,
                 log: Callable[[str], None] = print) -> bytes | None:
    """The manifest bytes at `store` (None if absent), after checking the prefix is this artifact's to replace:
    the same kind and lineage (inputs and config). Another kind's or lineage's is refused before anything is
    written, unless `force` (then said in one line)."""
    raw = store.read_bytes(MANIFEST)
    if raw is None:
        return None
    try:
        theirs = parse_manifest(raw)
    except ManifestError as e:
        reason = f"a manifest flashdraft cannot read ({e})"
    else:
        if theirs.kind == kind and theirs.lineage.same_work(lineage):
            return raw  # this artifact's own earlier version: ours to replace
        other = "inputs" if theirs.lineage.inputs != lineage.inputs else "settings"
        reason = f"a {theirs.kind} artifact" if theirs.kind != kind else f"a {kind} artifact made from other {other}"
    if not force:
        raise PrefixOwned(f"{store.url} holds {reason} (created {_created(raw)}); nothing was written. Push to "
                          "another prefix, or replace it on purpose with `flashdraft sync push --force`")
    log(f"notice: replacing {reason} at {store.url} (--force)")
    return raw


def _created(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("created", "?"))
    except (ValueError, AttributeError):
        return "?"


def retire_manifest(store, read_at_start: bytes | None, earlier: set[str]) -> None:
    """Withdraw the prefix's manifest before any of its objects change (the old artifact stops existing), after
    checking it is still the one this writer read at its start (or still absent): another writer's newer commit is
    neither deleted nor written under."""
    if store.read_bytes(MANIFEST) != read_at_start:
        raise VerifyFailed(store.url, [Problem(MANIFEST, "another writer committed here since this one started; "
                                                         "nothing was changed: rerun to see what is there now")])
    if read_at_start is None:
        return
    store.put_bytes(EARLIER, json.dumps(sorted(earlier)).encode())
    store.delete(MANIFEST)


def open_for_writing(store, kind: str, lineage: Lineage) -> None:
    """Before objects are written one by one under a prefix (generate's batch uploads): refuse another run's
    artifact there, and withdraw this artifact's own manifest first, so no object changes under a live one."""
    raw = claim_prefix(store, kind, lineage)
    retire_manifest(store, raw, listed_by(store.read_bytes(EARLIER)) | listed_by(raw))


def changed_since(store, confirmed: dict[str, Listed]) -> list[str]:
    """Objects whose listing (size, ETag) changed since they were confirmed: one listing, not a head each."""
    now = store.list()
    return sorted(rel for rel, seen in confirmed.items()
                  if rel not in now or now[rel].size != seen.size or now[rel].etag != seen.etag)


def listed_by(raw: bytes | None) -> set[str]:
    """Paths a manifest (or the EARLIER list) names; nothing for one that is absent or unreadable."""
    if raw is None:
        return set()
    try:
        data = json.loads(raw)
    except ValueError:
        return set()
    if isinstance(data, list):
        return {p for p in data if isinstance(p, str)}
    try:
        return {e.path for e in parse_manifest(raw).files}
    except ManifestError:
        return set()

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def this_process() -> dict[str, Any]:
    """Who this process is, in terms no other process can mistake for its own: the host, the kernel's boot, the
    PID namespace and the pid with its start time. A pid alone names a process only inside one PID namespace
    (two containers on one host, `hostNetwork` pods, share a hostname but not their pids), and only until the
    pid is reused. Linux-only fields are None elsewhere, and then no lease is judged dead by its pid."""
    import socket

    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot": read("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns,
            "pid": os.getpid(), "started": _start_ticks(os.getpid())}


def _start_ticks(pid: int) -> int | None:
    """A process's start time since boot (clock ticks; /proc/PID/stat field 22), None if there is no such process
    in this namespace or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2 :].split()[19])  # fields after the command name, which may hold spaces
    except (ValueError, IndexError):
        return None


MAX_PID = 1 << 22  # Linux's ceiling (pid_max): anything larger in a lease is not a pid


def gone_here(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the lease's holder is certainly dead: it ran on this host, in this boot and in this PID namespace
    (so its pid means here what it meant there), and no process has that pid now, or the one that has it started
    at another time (the pid was reused). Anything less certain (another host or namespace, an older lease
    without these fields) is not judged: only the lapse of the lease frees it."""
    pid = holder.get("pid")
    same_place = all(holder.get(k) == me[k] and me[k] is not None for k in ("host", "boot", "pid_ns"))
    if not same_place or not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < MAX_PID:
        return False
    started = _start_ticks(pid)
    if started is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False  # alive, but its start time cannot be read: not judged
    return holder.get("started") is not None and started != holder.get("started")


class WriterLease:
    """One writer at a time under an S3 prefix: a small object (`.flashdraft-writer.json`, internal, never listed
    as data) created with If-None-Match, naming its holder (`this_process`) and a random token, renewed every
    RENEW_S seconds with If-Match on its own ETag, and deleted when the push ends. A second push finds it and stops
    before writing anything. A lease not renewed for LEASE_S seconds (by the store's clock), or whose holder is
    certainly dead (`gone_here`), is a killed push's and is taken over, so a rerun resumes.

    The holder stops writing the moment it cannot be sure the lease is still its own: when a renewal is refused
    (taken over: 412, or 404 where the store answers so to If-Match on a deleted key), and when no renewal has
    succeeded for STALE_S seconds (the store unreachable, the process paused) — well before another push may take
    the lease as lapsed. A failed renewal is retried, never fatal to the thread. On a local store the directory's
    lock does this job."""

    NAME = f"{INTERNAL_PREFIX}writer.json"
    LEASE_S, RENEW_S, RETRY_S = 120.0, 30.0, 5.0
    STALE_S = LEASE_S / 2  # by this process's own clock since its last successful renewal: stop writing

    def __init__(self, store, log: Callable[[str], None], program: str = "flashdraft sync push") -> None:
        import uuid

        self.store, self.log = store, log
        self.me = this_process()
        self.record = {"program": program, **self.me, "token": uuid.uuid4().hex}
        self.etag: str | None = None
        self.renewed_at = time.monotonic()
        self.lost = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def __enter__(self) -> WriterLease:
        data = json.dumps(self.record).encode()
        self.etag = self.store.write_if(self.NAME, data)
        if self.etag is None:
            self._take_over(data)
        self.renewed_at = time.monotonic()
        self.thread = threading.Thread(target=self._renew_loop, daemon=True, name="writer-lease")
        self.thread.start()
        return self

    def _take_over(self, data: bytes) -> None:
        found = self.store.read_with_age(self.NAME)
        if found is None:  # released between the two calls
            self.etag = self.store.write_if(self.NAME, data)
        else:
            raw, etag, age = found
            holder = _holder(raw)
            if not gone_here(holder, self.me) and age < self.LEASE_S:
                raise busy(self.store.url, holder, age)
            self.etag = self.store.write_if(self.NAME, data, if_match=etag)
            if self.etag is not None:
                self.log(f"push: took over the writer lease of a push that is gone ({_who(holder)}, last renewed "
                         f"{age:.0f} s ago)")
        if self.etag is None:
            raise PrefixBusy(f"{self.store.url}: another push took the writer lease at the same moment; nothing "
                             "was written: rerun once it has finished")

    def _renew_loop(self) -> None:
        wait = self.RENEW_S
        while not self.stop.wait(wait):
            try:
                self.renew()
                wait = self.RENEW_S
            except Exception:  # unreachable, refused, anything: retry soon; `check` stops the writes if it lasts
                wait = self.RETRY_S
            if self.lost.is_set():
                return

    def renew(self) -> None:
        with self.lock:
            if self.lost.is_set():
                return
            etag = self.store.write_if(self.NAME, json.dumps(self.record).encode(), if_match=self.etag)
            if etag is None:
                self.lost.set()
            else:
                self.etag, self.renewed_at = etag, time.monotonic()

    def check(self) -> None:
        """Before each write: raise if the lease was lost, or has gone unrenewed so long that another push may
        soon take it (this push must not write any more)."""
        if not self.lost.is_set() and time.monotonic() - self.renewed_at > self.STALE_S:
            self.lost.set()
            raise StoreError(f"{self.store.url}: this push could not renew its writer lease for "
                             f"{self.STALE_S:.0f} s (the store did not answer, or the process was paused); it stopped "
                             "writing before another push could take the lease: rerun to resume")
        if self.lost.is_set():
            raise StoreError(f"{self.store.url}: this push lost its writer lease (another push took it over); it "
                             "stopped writing: rerun to see what is there now")

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


def _who(holder: dict[str, Any]) -> str:
    """`program (pid P on HOST` as a lease names its holder; each field printed safely (`shown`: a newline in a
    crafted lease cannot print a line of its own)."""
    return (f"{shown(str(holder.get('program', 'another push')))} (pid {shown(str(holder.get('pid', '?')))} on "
            f"{shown(str(holder.get('host', '?')))}")


def busy(url: str, holder: dict[str, Any], age: float) -> PrefixBusy:
    return PrefixBusy(f"{url} is being written by {_who(holder)}, renewed {age:.0f} s ago); nothing was written: "
                      f"wait for it to finish (a dead one's lease lapses {WriterLease.LEASE_S:.0f} s after its last "
                      "renewal, then rerun)")


def live_writer(store) -> tuple[dict[str, Any], float] | None:
    """The holder of a writer lease at `store` renewed within its term (and its age), or None: read only."""
    found = store.read_with_age(WriterLease.NAME) if hasattr(store, "read_with_age") else None
    if found is None or found[2] >= WriterLease.LEASE_S:
        return None
    return _holder(found[0]), found[2]


def _holder(raw: bytes) -> dict[str, Any]:
    """A lease object's record, or {} for one that is not a JSON object (a crafted or damaged lease)."""
    try:
        holder = json.loads(raw)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


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


EARLIER = f"{INTERNAL_PREFIX}earlier-files.json"  # in the store while a push writes: whose, and what it may replace


class PrefixOwned(ExpectedFailure):
    """The store prefix holds another run's artifact: writing there would replace it."""


def claim_prefix(store, kind: str, lineage: Lineage, *, force: bool = False,
                 log: Callable[[str], None] = print) -> bytes | None:
    """The manifest bytes at `store` (None if absent), after checking the prefix is this artifact's to replace:
    the same kind and lineage (inputs and config). Another kind's or lineage's is refused before anything is
    written, unless `force` (then said in one line). Without a manifest, the record an interrupted push left
    (`EARLIER`: its kind, lineage and the files it may replace) is judged the same way, so a push killed after it
    withdrew its manifest does not leave its files to whoever pushes next."""
    raw = store.read_bytes(MANIFEST)
    if raw is None:
        reason = _interrupted_owner(store.read_bytes(EARLIER), kind, lineage)
        if reason is None:
            return None
        if (live := live_writer(store)) is not None and not gone_here(live[0], this_process()):
            raise busy(store.url, *live)  # not interrupted: another run is writing there now
        created = "by a push that was interrupted"
    else:
        created = f"created {_created(raw)}"
        try:
            theirs = parse_manifest(raw)
        except ManifestError as e:
            reason = f"a manifest flashdraft cannot read ({e})"
        else:
            if theirs.kind == kind and theirs.lineage.same_work(lineage):
                return raw  # this artifact's own earlier version: ours to replace
            reason = _other_work(theirs.kind, theirs.lineage, kind, lineage)
    if not force:
        raise PrefixOwned(f"{store.url} holds {reason} ({created}); nothing was written. Push to another prefix, "
                          "or replace it on purpose with `flashdraft sync push --force`")
    log(f"notice: replacing {reason} at {store.url} (--force)")
    return raw


def _other_work(their_kind: str, theirs: Lineage, kind: str, lineage: Lineage) -> str:
    other = "inputs" if theirs.inputs != lineage.inputs else "settings"
    return f"a {their_kind} artifact" if their_kind != kind else f"a {kind} artifact made from other {other}"


def _interrupted_owner(raw: bytes | None, kind: str, lineage: Lineage) -> str | None:
    """Why the files an interrupted push left are not this push's to replace (None: they are, or there are none)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        their_kind, theirs = record["kind"], Lineage.model_validate(record["lineage"])
    except (ValueError, TypeError, KeyError):  # not JSON, an older list of paths, a record of the wrong shape
        return "the files of an interrupted push that does not say what it was writing"
    if their_kind == kind and theirs.same_work(lineage):
        return None
    return "the files of an interrupted push of " + _other_work(shown(str(their_kind)), theirs, kind, lineage)


def _created(raw: bytes) -> str:
    try:
        return shown(str(json.loads(raw).get("created", "?")))
    except (ValueError, AttributeError):
        return "?"


def retire_manifest(store, read_at_start: bytes | None, earlier: set[str], kind: str, lineage: Lineage) -> None:
    """Before any object under the prefix changes: record who writes there and what it may replace (`EARLIER`,
    kept until its commit, so a push killed midway leaves an owner behind), then withdraw the prefix's manifest
    (the old artifact stops existing) after checking it is still the one this writer read at its start (or still
    absent): another writer's newer commit is neither deleted nor written under."""
    if store.read_bytes(MANIFEST) != read_at_start:
        raise VerifyFailed(store.url, [Problem(MANIFEST, "another writer committed here since this one started; "
                                                         "nothing was changed: rerun to see what is there now")])
    record = {"kind": kind, "lineage": lineage.model_dump(), "files": sorted(earlier)}
    store.put_bytes(EARLIER, json.dumps(record).encode())
    if read_at_start is not None:
        store.delete(MANIFEST)


def open_for_writing(store, kind: str, lineage: Lineage) -> None:
    """Before objects are written one by one under a prefix (generate's batch uploads, under its writer lease):
    refuse another run's artifact there, and withdraw this artifact's own manifest first, so no object changes
    under a live one."""
    raw = claim_prefix(store, kind, lineage)
    retire_manifest(store, raw, listed_by(store.read_bytes(EARLIER)) | listed_by(raw), kind, lineage)


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
    if isinstance(data, dict) and "format" not in data:  # the EARLIER record (a manifest has a format)
        data = data.get("files")
    if isinstance(data, list):
        return {p for p in data if isinstance(p, str)}
    try:
        return {e.path for e in parse_manifest(raw).files}
    except ManifestError:
        return set()

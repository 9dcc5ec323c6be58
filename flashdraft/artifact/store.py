"""Where artifacts live: a local directory or an S3-compatible prefix, behind one small interface.

    s3://bucket/some/prefix   → S3Store (boto3; endpoint, region, credentials from the standard AWS chain)
    any other path            → LocalStore

Every put is verified by the store itself: S3 gets the manifest's SHA-256 (single part) or per-part and
full-object CRC64NVME (multipart) and rejects a body that does not match (BadDigest); the local store hashes
what it wrote. `head` returns the checksum the store holds, so `sync` and `verify` compare content, never mtime.
"""

from __future__ import annotations

import base64
import logging
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from flashdraft.artifact.atomic import temp_path_for
from flashdraft.artifact.manifest import (
    HASH_CHUNK,
    MANIFEST,
    FileEntry,
    StreamingDigest,
    digest_file,
    is_internal,
    list_data_files,
)
from flashdraft.errors import ExpectedFailure

Progress = Callable[[int], None]  # called with a number of bytes just moved

DEFAULT_PART_SIZE = 8 << 20  # aws-cli's; 64 MB parts measured 1.3x slower (benchmarks/RESULTS.md, sync)
MIN_PART_SIZE = 5 << 20  # S3's floor for every part but the last
MAX_PARTS = 10_000  # S3's ceiling on parts of one upload: past 80 GB the parts grow
SINGLE_PUT_LIMIT = 5 << 30  # S3's largest single PUT
PART_WORKERS = 4  # parts of one multipart upload in flight at once
ABANDONED_UPLOAD_S = 24 * 3600  # an open multipart upload older than this is a killed push's, not a live one's


class StoreError(ExpectedFailure):
    """The store refused, could not be reached, or holds something other than what was sent."""


@dataclass(frozen=True)
class Remote:
    """What the store says about one object: its size and the checksums it can vouch for (hex)."""

    size: int
    sha256: str | None = None
    crc64nvme: str | None = None

    def matches(self, entry: FileEntry) -> bool:
        if self.size != entry.size:
            return False
        if self.sha256 is not None:
            return self.sha256 == entry.sha256
        return self.crc64nvme is not None and self.crc64nvme == entry.crc64nvme


@dataclass(frozen=True)
class Listed:
    """One object as a listing shows it. The ETag changes whenever the object is overwritten."""

    size: int
    etag: str | None = None


def is_url(location: str) -> bool:
    return location.startswith("s3://")


def open_store(location: str, *, profile: str | None = None, endpoint_url: str | None = None, jobs: int = 8):
    from flashdraft.redact import USERINFO, redact

    if USERINFO.search(location):
        raise StoreError(f"{redact(location)}: a store URL carries no credentials (user:password@); they come from "
                         "the standard AWS chain (--profile, AWS_ACCESS_KEY_ID/…, ~/.aws)")
    if is_url(location):
        from botocore.exceptions import BotoCoreError

        try:
            return S3Store(location, profile=profile, endpoint_url=endpoint_url, jobs=jobs)
        except BotoCoreError as e:  # unknown profile, malformed ~/.aws config, bad endpoint URL
            raise StoreError(f"cannot open {location}: {e}") from None
    if "://" in location:
        raise StoreError(f"unsupported store URL {location!r}: use a local directory or s3://bucket/prefix")
    return LocalStore(location)


# ---------------------------------------------------------------------------------------------- local


class LocalStore:
    """A directory. Writes go through temp names + rename; `head` re-hashes (there is no server to ask)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = str(root)

    def list(self) -> dict[str, Listed]:
        if not self.root.is_dir():
            return {}
        names = list_data_files(self.root)
        if (self.root / MANIFEST).is_file():
            names.append(MANIFEST)
        return {n: Listed((self.root / n).stat().st_size) for n in names}

    def listed(self, rel: str) -> Listed | None:
        path = self.root / rel
        return Listed(path.stat().st_size) if path.is_file() else None

    def head(self, rel: str) -> Remote | None:
        path = self.root / rel
        if not path.is_file():
            return None
        digest = digest_file(path)
        return Remote(path.stat().st_size, digest.sha256, digest.crc64nvme)

    def upload(self, local: Path, entry: FileEntry, progress: Progress, part_size: int = DEFAULT_PART_SIZE, *,
               if_match: str | None = None, if_absent: bool = False) -> str | None:
        """Copy one file in, verified. The conditions are S3's; a local destination is locked by its writer."""
        write_verified(_file_chunks(local), self.root / entry.path, entry, progress)
        return None

    def download(self, rel: str, dest: Path, entry: FileEntry, progress: Progress) -> None:
        write_verified(_file_chunks(self.root / rel), dest, entry, progress)

    def hash_object(self, rel: str) -> str:
        return digest_file(self.root / rel).sha256

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def put_manifest(self, data: bytes) -> None:
        """Create-if-absent, as S3's conditional put: a hard link of a complete temp file appears atomically and
        fails when a manifest is already there, so of two writers the later one fails."""
        path = self.root / MANIFEST
        tmp = temp_path_for(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                if path.read_bytes() != data:
                    raise StoreError(f"{self.url}: another writer committed a different manifest meanwhile") from None
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, rel: str, data: bytes) -> None:
        from flashdraft.artifact.atomic import atomic_write_bytes

        atomic_write_bytes(self.root / rel, data)

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            yield chunk


def write_verified(chunks: Iterable[bytes], dest: Path, entry: FileEntry, progress: Progress) -> None:
    """Write `chunks` to a temp sibling of `dest`, hashing them; rename into place only if they match the entry."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(dest)
    digest = StreamingDigest()
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                digest.update(chunk)
                out.write(chunk)
                progress(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        got = digest.digest()
        if got.sha256 != entry.sha256:
            raise StoreError(f"{entry.path}: bytes do not match the manifest (sha256 {got.sha256[:12]}…)")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- S3


def _b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def _hex(b64_digest: str | None) -> str | None:
    return base64.b64decode(b64_digest).hex() if b64_digest else None


class SecretRedactor(logging.Filter):
    """Scrubs credentials from every log record (botocore's debug logs include signed headers)."""

    SIGNATURE = re.compile(r"(Signature=|Credential=|X-Amz-Security-Token[=:]\s*)[^\s,'\"&]+")

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s and len(s) >= 4]

    def redact(self, text: str) -> str:
        from flashdraft.redact import redact

        for secret in self.secrets:
            text = text.replace(secret, "***")
        return redact(self.SIGNATURE.sub(r"\1***", text))

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.redact(record.getMessage())
        record.args = None
        return True


class S3Store:
    """An s3://bucket/prefix on AWS S3 or any S3-compatible server."""

    def __init__(self, url: str, *, profile: str | None = None, endpoint_url: str | None = None, jobs: int = 8):
        import boto3
        from botocore.config import Config

        self.url = url.rstrip("/")
        bucket, _, prefix = self.url[len("s3://") :].partition("/")
        if not bucket:
            raise StoreError(f"{url!r} has no bucket: use s3://bucket/prefix")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        session = boto3.session.Session(profile_name=profile)
        self.endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(
            retries={"max_attempts": int(os.environ.get("FLASHDRAFT_S3_ATTEMPTS", "6")), "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=max(10, jobs * 2),
            # flashdraft supplies its own checksums (from the manifest); botocore need not compute more.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # Over plain HTTP (an in-cluster SeaweedFS/MinIO) botocore would otherwise read and SHA-256 every body
            # a second time to sign it. Every body flashdraft sends carries its own checksum header (the manifest's
            # CRC64NVME or SHA-256, a part's CRC64NVME, the whole object's on completion), which the signature covers
            # and the server checks before an object appears; so the body need not be signed too (botocore's own
            # choice over HTTPS).
            s3={"payload_signing_enabled": False},
        )
        self.client = session.client(
            "s3", endpoint_url=self.endpoint, region_name=session.region_name or "us-east-1", config=config
        )
        creds = session.get_credentials()
        self.has_credentials = creds is not None  # what preflight reports (a request would say "Unable to locate")
        frozen = creds.get_frozen_credentials() if creds else None
        self.redactor = SecretRedactor([frozen.access_key, frozen.secret_key, frozen.token or ""] if frozen else [])

    # -- plumbing

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _call(self, what: str, fn: Callable, missing_ok: bool = False, **kwargs):
        """One S3 call; every failure becomes a StoreError naming what was tried (None for a missing key
        when `missing_ok`)."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "?")
            if missing_ok and code in ("404", "NoSuchKey", "NotFound"):
                return None
            message = e.response.get("Error", {}).get("Message", "")
            raise StoreError(self.redactor.redact(f"{what}: {code}: {message}")) from None
        except NoCredentialsError:
            raise StoreError(f"{what}: no credentials found in the AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                             "AWS_PROFILE or --profile, ~/.aws/credentials, an instance role)") from None
        except BotoCoreError as e:
            where = self.endpoint or "the default S3 endpoint"
            raise StoreError(self.redactor.redact(f"{what}: cannot reach {where} after retries: {e}")) from None

    # -- interface

    def abort_incomplete_uploads(self, older_than_s: float | None = None) -> int:
        """Abort the multipart uploads under this prefix that were started more than `older_than_s` ago: what a
        killed push left open (the server keeps their parts, and bills them, until then). A younger one may be a
        live push's, and is left alone."""
        from datetime import UTC, datetime

        paginator = self.client.get_paginator("list_multipart_uploads")
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self._call(f"list uploads {self.url}", lambda **kw: list(paginator.paginate(**kw)), Prefix=base)
        now, older_than_s = datetime.now(UTC), ABANDONED_UPLOAD_S if older_than_s is None else older_than_s
        uploads = [u for page in pages for u in page.get("Uploads", [])
                   if "Initiated" in u and (now - u["Initiated"]).total_seconds() > older_than_s]
        for u in uploads:
            self._call(f"abort upload {u['Key']}", self.client.abort_multipart_upload, missing_ok=True,
                       Key=u["Key"], UploadId=u["UploadId"])
        return len(uploads)

    def list(self) -> dict[str, Listed]:
        found: dict[str, Listed] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self._call(f"list {self.url}", lambda **kw: list(paginator.paginate(**kw)), Prefix=base)
        for page in pages:
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(base) :]
                if rel and not is_internal(rel):
                    found[rel] = Listed(obj["Size"], obj.get("ETag"))
        return found

    def listed(self, rel: str) -> Listed | None:
        """One object as a listing shows it (size, ETag), or None: what a conditional write over it needs."""
        key = self.key(rel)
        page = self._call(f"list {rel}", self.client.list_objects_v2, Prefix=key, MaxKeys=1)
        found = [obj for obj in page.get("Contents", []) if obj["Key"] == key]
        return Listed(found[0]["Size"], found[0].get("ETag")) if found else None

    def head(self, rel: str) -> Remote | None:
        key = self.key(rel)
        r = self._call(f"head {rel}", self.client.head_object, missing_ok=True, Key=key, ChecksumMode="ENABLED")
        if r is None:
            return None
        return Remote(r["ContentLength"], _hex(r.get("ChecksumSHA256")), _hex(r.get("ChecksumCRC64NVME")))

    def upload(self, local: Path, entry: FileEntry, progress: Progress, part_size: int = DEFAULT_PART_SIZE, *,
               if_match: str | None = None, if_absent: bool = False) -> str | None:
        """Send one file, checked by the server against the manifest's checksum; returns the ETag it got. With
        `if_absent` (If-None-Match) or `if_match` (an ETag) the object is written only over the version the
        caller saw: another writer's object in between makes it fail (PreconditionFailed) and keeps theirs."""
        part_size = max(part_size, MIN_PART_SIZE)
        condition = {"IfMatch": if_match} if if_match else ({"IfNoneMatch": "*"} if if_absent else {})
        try:
            return self._upload(local, entry, progress, part_size, condition)
        except StoreError as e:
            if "PreconditionFailed" not in str(e) and ": 412:" not in str(e):  # the code, not a port that holds 412
                raise
            raise StoreError(f"{entry.path}: another writer changed it since this push started (theirs was kept); "
                             "rerun once the other push has finished") from None

    def _upload(self, local: Path, entry: FileEntry, progress: Progress, part_size: int, condition: dict) -> str | None:
        if entry.size <= min(part_size, SINGLE_PUT_LIMIT):
            with open(local, "rb") as f:
                # The server checks the body against the manifest's CRC64NVME (its SHA-256 for a manifest without
                # one) and rejects a mismatch: this is where a push finds a local file changed since its manifest
                # (it is not hashed beforehand). CRC64NVME as for multipart uploads: the server's check costs a
                # fraction of a SHA-256 pass (1.1x faster pushes on a 2-core machine serving its own store); the
                # SHA-256 stays the artifact's identity, re-hashed by every pull and `verify --deep`.
                try:
                    r = self._call(
                        f"upload {entry.path}",
                        self.client.put_object,
                        Key=self.key(entry.path),
                        Body=f,
                        ContentLength=entry.size,
                        **({"ChecksumCRC64NVME": _b64(entry.crc64nvme)} if entry.crc64nvme else
                           {"ChecksumSHA256": _b64(entry.sha256)}),
                        **condition,
                    )
                except StoreError as e:
                    if not any(code in str(e) for code in ("BadDigest", "ChecksumMismatch", "InvalidDigest")):
                        raise
                    raise StoreError(f"{entry.path}: content differs from the manifest (the store computed another "
                                     f"checksum and kept nothing): the local file changed since its manifest was "
                                     f"written ({e})") from None
            progress(entry.size)
            return r.get("ETag")
        # past S3's single-PUT limit even a "whole files" push sends parts
        return self._upload_multipart(local, entry, progress, part_size if part_size < SINGLE_PUT_LIMIT
                                      else DEFAULT_PART_SIZE, condition)

    def _upload_multipart(self, local: Path, entry: FileEntry, progress: Progress, part_size: int,
                          condition: dict) -> str | None:
        from awscrt.checksums import crc64nvme

        part_size = max(part_size, -(-entry.size // MAX_PARTS))
        key = self.key(entry.path)
        upload = self._call(
            f"upload {entry.path}",
            self.client.create_multipart_upload,
            Key=key,
            ChecksumAlgorithm="CRC64NVME",
            ChecksumType="FULL_OBJECT",
        )
        upload_id = upload["UploadId"]
        digest = StreamingDigest()
        parts = []

        def send(number: int, part: bytes) -> dict:
            r = self._call(f"upload {entry.path} part {number}", self.client.upload_part, Key=key,
                           UploadId=upload_id, PartNumber=number, Body=part,
                           ChecksumCRC64NVME=_b64(f"{crc64nvme(part):016x}"))
            progress(len(part))
            return {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC64NVME": r["ChecksumCRC64NVME"]}

        # Parts go PART_WORKERS at a time (the file is read and hashed in order on this thread); at most that
        # many parts are held in memory, plus the one being read.
        pool = ThreadPoolExecutor(max_workers=PART_WORKERS, thread_name_prefix="part")
        try:
            in_flight: deque = deque()
            with open(local, "rb") as f:
                number = 0
                while part := f.read(part_size):
                    number += 1
                    digest.update(part)
                    if len(in_flight) >= PART_WORKERS:
                        parts.append(in_flight.popleft().result())
                    in_flight.append(pool.submit(send, number, part))
            parts.extend(future.result() for future in in_flight)
            got = digest.digest()
            if got.sha256 != entry.sha256:
                raise StoreError(f"{entry.path}: local file changed since its manifest was written (sha256 differs)")
            # The server checks the whole object against the manifest's CRC64NVME before the object appears.
            done = self._call(
                f"upload {entry.path}",
                self.client.complete_multipart_upload,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                ChecksumCRC64NVME=_b64(entry.crc64nvme or got.crc64nvme),
                ChecksumType="FULL_OBJECT",
                **condition,
            )
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # no part may land after the abort
            try:  # best effort: the server may be what failed; the original error is the one to report
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:
                pass
            raise
        finally:
            pool.shutdown(wait=True)
        return done.get("ETag")

    def download(self, rel: str, dest: Path, entry: FileEntry, progress: Progress) -> None:
        body = self._call(f"download {rel}", self.client.get_object, Key=self.key(rel))["Body"]
        write_verified(body.iter_chunks(HASH_CHUNK), dest, entry, progress)

    def hash_object(self, rel: str) -> str:
        """Deep check: stream the object and hash it here."""
        digest = StreamingDigest()
        body = self._call(f"download {rel}", self.client.get_object, Key=self.key(rel))["Body"]
        for chunk in body.iter_chunks(HASH_CHUNK):
            digest.update(chunk)
        return digest.digest().sha256

    def read_bytes(self, rel: str) -> bytes | None:
        r = self._call(f"read {rel}", self.client.get_object, missing_ok=True, Key=self.key(rel))
        return None if r is None else r["Body"].read()

    def read_with_age(self, rel: str) -> tuple[bytes, str, float] | None:
        """A small object's bytes, ETag and age in seconds by the server's own clock (its Date header against the
        object's Last-Modified), so hosts with skewed clocks agree on it. None if absent."""
        from email.utils import parsedate_to_datetime

        r = self._call(f"read {rel}", self.client.get_object, missing_ok=True, Key=self.key(rel))
        if r is None:
            return None
        served = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        now = parsedate_to_datetime(served) if served else None
        age = (now - r["LastModified"]).total_seconds() if now is not None else 0.0
        return r["Body"].read(), r.get("ETag", ""), max(0.0, age)

    def write_if(self, rel: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """Write a small object only if it is absent (`if_match` None) or still the version `if_match` names;
        returns its new ETag, or None when another writer's version is there (PreconditionFailed) or the version
        named is gone (AWS answers If-Match on a missing key with 404 NoSuchKey, SeaweedFS with 412: both mean
        "not yours any more")."""
        import hashlib

        from botocore.exceptions import BotoCoreError, ClientError

        condition = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=data,
                                       ChecksumSHA256=_b64(hashlib.sha256(data).hexdigest()), **condition)
        except BotoCoreError as e:
            raise StoreError(self.redactor.redact(f"write {rel}: cannot reach the store: {e}")) from None
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return None
            if if_match and code in ("NoSuchKey", "404", "NotFound"):  # AWS answers If-Match on a deleted key so
                return None
            raise StoreError(self.redactor.redact(f"write {rel}: {e}")) from None
        return r.get("ETag")

    def put_bytes(self, rel: str, data: bytes) -> None:
        """A small object flashdraft keeps for itself (under an internal name)."""
        import hashlib

        self._call(f"write {rel}", self.client.put_object, Key=self.key(rel), Body=data,
                   ChecksumSHA256=_b64(hashlib.sha256(data).hexdigest()))

    def put_manifest(self, data: bytes) -> None:
        """Conditional create: the manifest appears once, whole, and never over another writer's."""
        import hashlib

        from botocore.exceptions import ClientError

        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=self.key(MANIFEST),
                Body=data,
                ChecksumSHA256=_b64(hashlib.sha256(data).hexdigest()),
                IfNoneMatch="*",
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "412"):
                raise StoreError(self.redactor.redact(f"commit manifest: {e}")) from None
            if self.read_bytes(MANIFEST) != data:
                raise StoreError(f"{self.url}: another writer committed a different manifest meanwhile") from None

    def delete(self, rel: str) -> None:
        self._call(f"delete {rel}", self.client.delete_object, Key=self.key(rel))

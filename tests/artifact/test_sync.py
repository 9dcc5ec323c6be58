"""sync / verify against a real S3-compatible server (SeaweedFS on 127.0.0.1) and local directories."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from flashdraft.artifact.manifest import MANIFEST, FileEntry, build_manifest, read_manifest, write_manifest
from flashdraft.artifact.store import S3Store, StoreError, open_store
from flashdraft.artifact.sync import VerifyFailed, check_objects, pull, push, transfer_progress, verify_store
from tests.servers import TcpForwarder


def last_json(proc) -> dict:
    return json.loads(proc.stdout)


@pytest.fixture
def url(s3env) -> str:
    return f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}/art"


def make_artifact(root: Path, sizes=(1000, 2000, 300_000), kind="files") -> Path:
    (root / "sub").mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        (root / ("sub" if i % 2 else ".") / f"f{i}.bin").write_bytes(os.urandom(size))
    write_manifest(root, build_manifest(root, kind=kind))
    return root


def keys(seaweed, url: str) -> dict[str, int]:
    bucket, _, prefix = url[5:].partition("/")
    listing = seaweed.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1 :]: o["Size"] for o in listing.get("Contents", [])}


def test_push_then_noop_then_verify(cli, tmp_path, url, s3env):
    make_artifact(tmp_path / "a")
    first = cli("sync", "push", str(tmp_path / "a"), url, "--json", check=True)
    assert last_json(first) | {"bytes_uploaded": 0} == {
        "ok": True,
        "uploaded": 3,
        "bytes_uploaded": 0,
        "skipped": 0,
        "deleted": 0,
        "verified": 3,
        "already_done": False,
    }
    assert last_json(first)["bytes_uploaded"] == 303_000
    assert "verified 3" in first.stderr  # with --json, human output goes to stderr
    assert set(keys(s3env, url)) == {"f0.bin", "sub/f1.bin", "f2.bin", MANIFEST}

    again = cli("sync", "push", str(tmp_path / "a"), url, "--json", check=True)
    assert last_json(again)["uploaded"] == 0 and last_json(again)["bytes_uploaded"] == 0
    assert last_json(again)["verified"] == 3 and "already done, verified" in again.stderr

    for deep in ([], ["--deep"]):
        ok = cli("verify", url, "--json", *deep, check=True)
        assert last_json(ok) == {"ok": True, "problems": []}


def test_same_size_edit_with_old_mtime_is_sent_and_identical_files_are_not(cli, tmp_path, url):
    a = make_artifact(tmp_path / "a")
    cli("sync", "push", str(a), url, check=True)
    data = bytearray((a / "f2.bin").read_bytes())
    data[123] ^= 0x55
    (a / "f2.bin").write_bytes(bytes(data))
    os.utime(a / "f2.bin", (1_000_000, 1_000_000))  # older than the uploaded copy
    proc = cli("sync", "push", str(a), url, "--json", check=True)
    summary = last_json(proc)
    assert summary["uploaded"] == 1 and summary["skipped"] == 2 and summary["bytes_uploaded"] == 300_000
    assert "changed since its manifest" in proc.stderr
    pulled = tmp_path / "b"
    cli("sync", "pull", url, str(pulled), check=True)
    assert (pulled / "f2.bin").read_bytes() == bytes(data)


def test_stage_artifact_that_does_not_verify_is_refused(cli, tmp_path, url, s3env):
    """Its bytes are checked once: a file about to be sent by the store as it arrives, one already there by a
    local re-hash before anything is written. Either way the push fails naming it, and no manifest appears."""
    a = make_artifact(tmp_path / "a", kind="dataset")
    (a / "f0.bin").write_bytes(b"x" * 1000)  # same size, other bytes
    proc = cli("sync", "push", str(a), url)
    assert proc.returncode == 1 and "f0.bin" in proc.stderr and "content differs" in proc.stderr
    assert MANIFEST not in keys(s3env, url)

    b = make_artifact(tmp_path / "b", kind="dataset")
    other = f"{url}-b"
    cli("sync", "push", str(b), other, check=True)
    before = keys(s3env, other)
    (b / "f0.bin").write_bytes(b"x" * 1000)  # the store still holds the manifest's f0.bin: nothing to send
    proc = cli("sync", "push", str(b), other)
    assert proc.returncode == 1 and "f0.bin" in proc.stderr and "content differs" in proc.stderr
    assert keys(s3env, other) == before


def test_delete_removes_unlisted_remote_files(cli, tmp_path, url, s3env):
    a = make_artifact(tmp_path / "a")
    cli("sync", "push", str(a), url, check=True)
    (a / "f0.bin").unlink()
    write_manifest(a, build_manifest(a))
    without = cli("sync", "push", str(a), url, "--json")
    assert without.returncode == 1
    assert last_json(without)["problems"] == [
        {"path": "f0.bin", "problem": "unlisted object: not in the manifest (push with --delete to remove it)"}
    ]
    # refused before anything changed: the pushed artifact is still there, whole, and still verifies
    assert cli("verify", url, check=True).returncode == 0
    with_delete = cli("sync", "push", str(a), url, "--delete", "--json", check=True)
    assert last_json(with_delete)["deleted"] == 1
    assert set(keys(s3env, url)) == {"sub/f1.bin", "f2.bin", MANIFEST}


def test_server_rejects_a_corrupted_single_part_body(tmp_path, url):
    a = make_artifact(tmp_path / "a")
    entry = read_manifest(a).files[0]
    (a / entry.path).write_bytes(os.urandom(entry.size))  # bytes on the wire ≠ the manifest's sha256
    store = S3Store(url)
    with pytest.raises(StoreError, match="content differs from the manifest"):
        store.upload(a / entry.path, entry, lambda n: None)
    assert store.head(entry.path) is None


def test_bodies_travel_unsigned_but_each_under_a_signed_checksum_the_server_checks(tmp_path, url):
    """No second client-side SHA-256 pass to sign a body over plain HTTP: each upload request names the body's
    checksum in a header (signed), and the server rejects a body that does not match it (the corrupted-body
    tests around this one)."""
    a = make_artifact(tmp_path / "a", sizes=(1000, 12 << 20))
    store = S3Store(url)
    seen = []

    def record(request, **_):
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        signed = headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
        seen.append((headers.get("x-amz-content-sha256"), [h for h in signed if h.startswith("x-amz-checksum-")]))

    store.client.meta.events.register("before-send.s3.PutObject", record)
    store.client.meta.events.register("before-send.s3.UploadPart", record)
    small, large = read_manifest(a).files
    store.upload(a / small.path, small, lambda n: None)
    store.upload(a / large.path, large, lambda n: None, part_size=5 << 20)
    assert len(seen) == 1 + 3  # one PUT, three parts
    for payload, signed_checksums in seen:
        assert payload == "UNSIGNED-PAYLOAD" and len(signed_checksums) == 1
    assert store.head(small.path).matches(small) and store.head(large.path).matches(large)


def test_enough_files_go_whole_and_few_large_ones_in_parts(tmp_path, s3env):
    """Files alone fill `jobs` connections when there are that many: one request each. Fewer large files are
    sent in parts, so their parts fill them. Both verify at the destination."""
    requests = []

    def pushed(sizes, jobs):
        art = make_artifact(tmp_path / f"a{len(requests)}", sizes=sizes, kind="dataset")
        store = S3Store(f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}/art", jobs=jobs)
        seen = []
        for op in ("PutObject", "UploadPart"):
            store.client.meta.events.register(f"before-send.s3.{op}", lambda request, op=op, **_: seen.append(op))
        push(art, store, jobs=jobs, log=lambda s: None)
        requests.append(seen)
        assert check_objects(store, read_manifest(art), jobs=2) == []
        return sorted(seen)

    # 3 files past the part floor, 3 jobs: each whole (+ the manifest and the earlier-files note)
    assert pushed((6 << 20, 6 << 20, 17 << 20), jobs=3).count("UploadPart") == 0
    # the same 3 files with 8 jobs: the 17 MB one goes in 8 MB parts
    assert pushed((6 << 20, 6 << 20, 17 << 20), jobs=8).count("UploadPart") == 3


def test_multipart_upload_is_checked_full_object(tmp_path, url, s3env):
    a = make_artifact(tmp_path / "a", sizes=(12 << 20,))
    entry = read_manifest(a).files[0]
    store = S3Store(url)
    wrong_crc = FileEntry(path=entry.path, size=entry.size, sha256=entry.sha256, crc64nvme="0" * 16)
    with pytest.raises(StoreError, match="upload f0.bin"):
        store.upload(a / entry.path, wrong_crc, lambda n: None, part_size=5 << 20)
    assert store.head(entry.path) is None  # rejected by the server: no object appeared

    store.upload(a / entry.path, entry, lambda n: None, part_size=5 << 20)
    head = s3env.client().head_object(Bucket="flashdraft", Key=store.key(entry.path), ChecksumMode="ENABLED")
    assert head["ChecksumType"] == "FULL_OBJECT" and head["ETag"].endswith('-3"')  # 3 parts
    assert store.head(entry.path).matches(entry)


def test_a_push_aborts_multipart_uploads_a_killed_push_left_open(tmp_path, url, s3env, monkeypatch):
    """What a push killed mid-upload leaves on the server (an open upload holding parts) is aborted by the next
    push to that destination once it is older than a live upload can be; a young one (perhaps a live push's) and
    uploads elsewhere in the bucket are not touched."""
    import flashdraft.artifact.store

    client = s3env.client()
    prefix = url[len("s3://flashdraft/"):]
    dead = client.create_multipart_upload(Bucket="flashdraft", Key=f"{prefix}/f0.bin")["UploadId"]
    client.upload_part(Bucket="flashdraft", Key=f"{prefix}/f0.bin", UploadId=dead, PartNumber=1,
                       Body=os.urandom(5 << 20))
    other = client.create_multipart_upload(Bucket="flashdraft", Key=f"{prefix}-elsewhere/x.bin")["UploadId"]

    def open_uploads(under: str) -> list[str]:
        return [u["UploadId"] for u in client.list_multipart_uploads(Bucket="flashdraft", Prefix=under)
                .get("Uploads", [])]

    assert open_uploads(f"{prefix}/") == [dead]
    lines = []
    push(make_artifact(tmp_path / "a"), open_store(url), log=lines.append)
    assert open_uploads(f"{prefix}/") == [dead] and not any("aborted" in x for x in lines)  # young: left alone
    (tmp_path / "a" / "f0.bin").write_bytes(os.urandom(1000))  # a change, so the next push writes again
    monkeypatch.setattr(flashdraft.artifact.store, "ABANDONED_UPLOAD_S", 0.0)  # as if a day had passed
    push(tmp_path / "a", open_store(url), log=lines.append)
    assert open_uploads(f"{prefix}/") == [] and any("aborted 1 multipart upload" in x for x in lines)
    assert open_uploads(f"{prefix}-elsewhere/") == [other]
    client.abort_multipart_upload(Bucket="flashdraft", Key=f"{prefix}-elsewhere/x.bin", UploadId=other)


def test_manifest_is_a_conditional_create(tmp_path, url):
    a = make_artifact(tmp_path / "a")
    store = open_store(url)
    push(a, store, log=lambda s: None)
    store.put_manifest((a / MANIFEST).read_bytes())  # same bytes: fine
    with pytest.raises(StoreError, match="another writer"):
        store.put_manifest(b'{"format": 1}')


def test_out_of_band_overwrite_fails_verify_and_next_push_repairs(cli, tmp_path, url, s3env):
    a = make_artifact(tmp_path / "a")
    cli("sync", "push", str(a), url, check=True)
    bucket, _, prefix = url[5:].partition("/")
    s3env.client().put_object(Bucket=bucket, Key=f"{prefix}/sub/f1.bin", Body=os.urandom(2000))  # same size
    proc = cli("verify", url, "--json")
    assert proc.returncode == 1
    assert [p["path"] for p in last_json(proc)["problems"]] == ["sub/f1.bin"]
    assert "sub/f1.bin" in proc.stderr
    repaired = cli("sync", "push", str(a), url, "--json", check=True)
    assert last_json(repaired)["uploaded"] == 1
    cli("verify", url, "--deep", check=True)


def test_verify_names_missing_object_and_missing_manifest(cli, tmp_path, url, s3env):
    a = make_artifact(tmp_path / "a")
    cli("sync", "push", str(a), url, check=True)
    bucket, _, prefix = url[5:].partition("/")
    s3env.client().delete_object(Bucket=bucket, Key=f"{prefix}/f2.bin")
    proc = cli("verify", url, "--json")
    assert proc.returncode == 1 and last_json(proc)["problems"][0]["path"] == "f2.bin"
    s3env.client().delete_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST}")
    proc = cli("verify", url, "--json")
    assert proc.returncode == 1 and last_json(proc)["problems"][0]["path"] == MANIFEST


def test_pull_refuses_unsafe_manifest_paths(cli, tmp_path, url, s3env):
    bucket, _, prefix = url[5:].partition("/")
    for evil in ["../escape.txt", "/etc/passwd-copy", "a/../../escape.txt"]:
        manifest = {
            "format": 1,
            "kind": "files",
            "created": "2026-01-01T00:00:00+00:00",
            "files": [{"path": evil, "size": 3, "sha256": "0" * 64}],
        }
        s3env.client().put_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST}", Body=json.dumps(manifest).encode())
        proc = cli("sync", "pull", url, str(tmp_path / "dst" / "inner"))
        assert proc.returncode == 1 and "unsafe" in proc.stderr, evil
    assert not (tmp_path / "dst" / "escape.txt").exists() and not (tmp_path / "escape.txt").exists()


def test_pull_resumes_and_rejects_corrupt_local_copies(tmp_path, url):
    a = make_artifact(tmp_path / "a")
    store = open_store(url)
    push(a, store, log=lambda s: None)
    b = tmp_path / "b"
    first = pull(store, b)
    assert first.transferred == 3 and (b / MANIFEST).read_bytes() == (a / MANIFEST).read_bytes()
    (b / "f0.bin").write_bytes(os.urandom(1000))  # same size, wrong content
    second = pull(store, b)
    assert second.transferred == 1 and second.skipped == 2
    assert (b / "f0.bin").read_bytes() == (a / "f0.bin").read_bytes()
    assert pull(store, b).already_done


def test_local_directory_as_store(cli, tmp_path):
    a = make_artifact(tmp_path / "a")
    proc = cli("sync", "push", str(a), str(tmp_path / "store"), "--json", check=True)
    assert last_json(proc)["uploaded"] == 3
    assert last_json(cli("sync", "push", str(a), str(tmp_path / "store"), "--json", check=True))["already_done"]
    cli("verify", str(tmp_path / "store"), check=True)
    assert pull(open_store(str(tmp_path / "store")), tmp_path / "c").verified == 3


# ------------------------------------------------------------------------------------------- faults

KILLABLE_PUSH = """
import sys, time
import flashdraft.artifact.store as store
real = store.S3Store.upload
def slow(self, *a, **k):
    real(self, *a, **k)
    time.sleep(0.15)
store.S3Store.upload = slow
from flashdraft.cli import app
app(["sync", "push", sys.argv[1], sys.argv[2], "--jobs", "1"], prog_name="flashdraft")
"""


def test_sigkilled_push_resumes_without_resending_finished_files(cli, tmp_path, url, s3env):
    a = make_artifact(tmp_path / "a", sizes=[20_000] * 30)
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE_PUSH, str(a), url])
    def data_keys() -> list[str]:  # not the push's own records (its writer lease, who is writing there)
        return [k for k in keys(s3env, url) if not k.startswith(".flashdraft-")]

    deadline = time.time() + 60
    while len(data_keys()) < 6 and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(data_keys())
    assert 6 <= done_before < 30 and MANIFEST not in keys(s3env, url)
    rerun = last_json(cli("sync", "push", str(a), url, "--json", check=True))
    assert rerun["skipped"] >= done_before - 1  # at most the one in flight is sent again
    assert rerun["uploaded"] + rerun["skipped"] == 30 and rerun["verified"] == 30
    cli("verify", url, check=True)


def test_unreachable_server_is_a_clear_error_after_retries(cli, tmp_path, monkeypatch):
    make_artifact(tmp_path / "a")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "2")
    proc = cli("sync", "push", str(tmp_path / "a"), "s3://flashdraft/x")
    assert proc.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port} after retries" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_server_that_comes_back_is_retried_with_backoff(cli, tmp_path, url, s3env, monkeypatch):
    a = make_artifact(tmp_path / "a")
    restarting = TcpForwarder(int(s3env.endpoint.rsplit(":", 1)[1]), refuse_for=1.5)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{restarting.port}")
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "8")
    proc = cli("sync", "push", str(a), url, "--json", check=True)
    assert last_json(proc)["verified"] == 3


# ------------------------------------------------------------------------------------------- secrets, progress


def test_credentials_never_appear_in_output_logs_or_files(cli, tmp_path, url, s3env):
    a = make_artifact(tmp_path / "a")
    proc = cli("sync", "push", str(a), url, "--verbose", "--json", check=True)
    assert "botocore" in proc.stderr  # debug logging really was on
    pulled = cli("sync", "pull", url, str(tmp_path / "b"), "--verbose", check=True)
    failed = cli("sync", "push", str(a), "s3://no-such-bucket-xyz/p", "--verbose")
    assert failed.returncode == 1
    written = b"".join(p.read_bytes() for p in (tmp_path).rglob("*") if p.is_file())
    for secret in (s3env.secret_key, s3env.access_key):
        for text in (proc.stdout, proc.stderr, pulled.stdout, pulled.stderr, failed.stdout, failed.stderr):
            assert secret not in text
        assert secret.encode() not in written


def test_progress_shows_bytes_per_second():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with transfer_progress(console, 10 << 20, "upload") as advance:
        for _ in range(10):
            advance(1 << 20)
            time.sleep(0.02)
    assert "/s" in buf.getvalue() and "upload" in buf.getvalue()


def test_verify_store_reports_problems_without_raising(tmp_path, url):
    store = open_store(url)
    [problem] = verify_store(store)
    assert problem.path == MANIFEST and "missing" in problem.problem
    with pytest.raises(VerifyFailed):
        a = make_artifact(tmp_path / "a", kind="dataset")
        (a / "extra.bin").write_bytes(b"1")
        push(a, store, log=lambda s: None)


def test_noop_resync_costs_one_listing_and_still_sees_overwrites(tmp_path, url, s3env):
    a = make_artifact(tmp_path / "a", sizes=[1000] * 20)
    push(a, open_store(url), log=lambda s: None)

    def pushed_with_head_count():
        store = open_store(url)
        heads = []
        store.client.meta.events.register(  # the objects' heads; a push also looks for a manifest before writes
            "before-parameter-build.s3.HeadObject",
            lambda params, **kw: None if params["Key"].endswith(MANIFEST) else heads.append(1))
        return push(a, store, log=lambda s: None), len(heads)

    result, heads = pushed_with_head_count()
    assert result.already_done and heads == 0  # the listing's unchanged ETags vouch for confirmed content

    bucket, _, prefix = url[5:].partition("/")
    s3env.client().put_object(Bucket=bucket, Key=f"{prefix}/f8.bin", Body=os.urandom(1000))  # out of band
    result, heads = pushed_with_head_count()
    assert not result.already_done and result.transferred == 1
    assert heads == 2  # that object only: once to find the change, once to confirm the repair
    assert not list_remote_problems(url)


def list_remote_problems(url):
    return verify_store(open_store(url), deep=True)


def test_a_store_that_returns_no_checksum_is_named_as_such(tmp_path):
    """Some S3-compatible stores keep no checksum for an object: verify says that, not "content differs"."""
    from flashdraft.artifact.store import LocalStore, Remote
    from flashdraft.artifact.sync import check_objects

    class NoChecksumStore(LocalStore):  # a real local store whose heads carry sizes only
        def head(self, rel):
            found = super().head(rel)
            return None if found is None else Remote(found.size)

    a = make_artifact(tmp_path / "a", sizes=(100,))
    dst = tmp_path / "dst"
    push(a, LocalStore(dst), log=lambda s: None)
    problems = check_objects(NoChecksumStore(dst), read_manifest(a), jobs=1)
    assert [p.path for p in problems] == ["f0.bin"] and "returned no checksum" in problems[0].problem
    # `verify --deep` does what that line says: it re-hashes the bytes, and so confirms them, or finds them changed
    assert verify_store(NoChecksumStore(dst), deep=True) == []
    (dst / "f0.bin").write_bytes(b"x" * 100)  # same size, other bytes
    assert [p.problem for p in verify_store(NoChecksumStore(dst), deep=True)] == [
        "content differs: re-hashed bytes do not match the manifest"]


def test_of_two_writers_to_one_local_store_the_later_fails(tmp_path):
    from flashdraft.artifact.store import LocalStore

    a = make_artifact(tmp_path / "a", sizes=(100,))
    store = LocalStore(tmp_path / "dst")
    push(a, store, log=lambda s: None)
    store.put_manifest((a / MANIFEST).read_bytes())  # the same bytes again: fine
    with pytest.raises(StoreError, match="another writer committed a different manifest"):
        store.put_manifest(b'{"format": 1}')
    assert (tmp_path / "dst" / MANIFEST).read_bytes() == (a / MANIFEST).read_bytes()


def test_a_pull_replaces_its_own_old_files_and_refuses_a_strangers(tmp_path):
    from flashdraft.artifact.ownership import OutputNotOwned
    from flashdraft.artifact.store import LocalStore

    old = make_artifact(tmp_path / "old", sizes=(100, 200), kind="dataset")
    new = tmp_path / "new"
    new.mkdir()
    (new / "other.bin").write_bytes(b"new version")
    write_manifest(new, build_manifest(new, kind="dataset"))
    store = LocalStore(tmp_path / "store")
    push(new, store, log=lambda s: None)
    local = tmp_path / "local"
    pull(_pushed(old, tmp_path / "old-store"), local)
    result = pull(store, local)  # the old version's files, named by its manifest, are this pull's to replace
    from flashdraft.artifact.manifest import list_data_files, verify_dir

    assert result.deleted == 2 and list_data_files(local) == ["other.bin"] and verify_dir(local) == []
    (local / "notes.txt").write_text("a user's")
    with pytest.raises(OutputNotOwned, match="also holds notes.txt"):
        pull(_pushed(old, tmp_path / "old-store"), local)
    assert (local / "notes.txt").read_text() == "a user's" and (local / "other.bin").is_file()


def _pushed(src: Path, root: Path):
    from flashdraft.artifact.store import LocalStore

    store = LocalStore(root)
    push(src, store, log=lambda s: None)
    return store

"""Trust at the edges, round 2 (issue 53): the writer lease across PID namespaces and store outages, generate's
uploads under it, an interrupted push's files, credentials and redirects, hangs, a read-only source, what a dry
run writes, and crafted records — reproduced with real CLI processes, real files, SeaweedFS and loopback servers.
Each failed on the code before the fix."""

import json
import os
import shlex
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flashdraft.artifact.manifest import MANIFEST, read_manifest
from flashdraft.artifact.prefix import EARLIER, PrefixBusy, WriterLease, this_process
from flashdraft.artifact.store import StoreError, open_store
from tests.artifact.test_ownership import tree_digest
from tests.forked_cli import run_cli
from tests.test_edges import many_files, s3_keys, small_artifact
from tests.test_trust import one_line_error

FLASHDRAFT = [sys.executable, "-m", "flashdraft"]


def new_url(name: str = "art") -> str:
    return f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}/{name}"


def can_unshare(*flags: str) -> bool:
    try:
        return subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ---------------------------------------------------------------------------------------------- the writer lease


@pytest.mark.skipif(not can_unshare("--pid", "--fork"), reason="needs `unshare --pid` (a PID namespace)")
def test_a_push_in_another_pid_namespace_never_takes_a_live_lease(tmp_path, s3env):
    """Two containers on one host (`--network host`): the same hostname, pids from different namespaces. The second
    push cannot see the first's pid, and must not take its lease for a dead one's."""
    url = new_url()
    src = many_files(tmp_path / "src", 3, 1000)
    with WriterLease(open_store(url), lambda line: None):  # a live push in this namespace
        proc = subprocess.run(["unshare", "--pid", "--fork", *FLASHDRAFT, "sync", "push", str(src), url],
                              capture_output=True, text=True, timeout=120)
        assert "being written by flashdraft sync push" in one_line_error(proc)
        assert set(s3_keys(s3env, url)) == {WriterLease.NAME}  # nothing written beside the live lease


def test_only_a_holder_dead_in_this_very_namespace_is_taken_over(tmp_path, s3env):
    """A lease naming this host with a pid that no process here has is taken over only when its boot and PID
    namespace are this process's too; a reused pid (alive, started at another time) counts as dead."""
    url = new_url()
    src = many_files(tmp_path / "src", 2, 1000)
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = this_process()
    for elsewhere, taken in [({"pid_ns": "pid:[1]"}, False), ({"boot": "another-boot"}, False),
                             ({"pid_ns": None, "boot": None}, False), ({}, True)]:
        store = open_store(url)
        store.delete(WriterLease.NAME)
        holder = {"program": "flashdraft sync push", **me, "pid": dead.pid, "token": "t", **elsewhere}
        assert store.write_if(WriterLease.NAME, json.dumps(holder).encode())
        lines = []
        if taken:
            from flashdraft.artifact.sync import push

            assert push(src, store, log=lines.append).verified == 2
            assert any("took over the writer lease" in line for line in lines)
        else:
            with pytest.raises(PrefixBusy, match="being written by"):
                WriterLease(store, lines.append).__enter__()
    reused = {"program": "x", **me, "pid": os.getpid(), "started": (me["started"] or 0) + 1, "token": "t"}
    from flashdraft.artifact.prefix import gone_here

    assert gone_here(reused, me) and not gone_here({**reused, "started": me["started"]}, me)


def test_a_lease_that_cannot_be_renewed_stops_the_writes_and_its_thread_lives_on(tmp_path, s3env, monkeypatch):
    """The store goes away while a push holds the lease: the renewal thread keeps trying (it does not die with a
    traceback), and the holder stops writing well before another push may take the lease as lapsed."""
    from tests.servers import TcpForwarder

    port = int(s3env.endpoint.rsplit(":", 1)[1])
    forwarder = TcpForwarder(port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{forwarder.port}")
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "1")
    monkeypatch.setattr(WriterLease, "RENEW_S", 0.2)
    monkeypatch.setattr(WriterLease, "RETRY_S", 0.1)
    monkeypatch.setattr(WriterLease, "STALE_S", 1.5)
    failures = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    lease = WriterLease(open_store(new_url()), lambda line: None)
    with lease:
        lease.check()
        forwarder.cut()  # the store is unreachable from here on
        time.sleep(2.5)
        assert lease.thread.is_alive() and failures == []
        with pytest.raises(StoreError, match="could not renew its writer lease"):
            lease.check()
        with pytest.raises(StoreError):
            lease.check()  # and it stays stopped


def test_a_crafted_lease_object_is_one_line_never_a_traceback_or_a_forged_line(cli, tmp_path, s3env):
    src = many_files(tmp_path / "src", 2, 1000)
    me = this_process()
    for crafted in [b"[1]", json.dumps({"host": me["host"], "pid": 10**20}).encode(),
                    json.dumps({"program": "push\nerror: forged", "pid": "1\n2"}).encode(), b"\xff\xfe"]:
        url = new_url()
        assert open_store(url).write_if(WriterLease.NAME, crafted)
        proc = cli("sync", "push", str(src), url)
        assert "being written by" in one_line_error(proc)  # one `error:` line: a newline in a field forges none


# ---------------------------------------------------------------------------------------------- generate's uploads


def test_generate_uploads_only_under_the_prefix_lease(cli, tmp_path, tiny_model_dir, s3env):
    """A live push holds the prefix: generate --upload-to stops before it generates or writes anything there; once
    the prefix is free it uploads its batches under its own lease, commits, and leaves no lease behind."""
    from tests.generate.test_generate import prompts_file

    url = new_url("gen")
    src = prompts_file(tmp_path / "p.jsonl", 4)
    args = ["generate", "--prompts", src, "--out", str(tmp_path / "gen"), "--model", tiny_model_dir,
            "--max-new-tokens", "2", "--batch-size", "2", "--upload-to", url]
    with WriterLease(open_store(url), lambda line: None):
        assert "being written by flashdraft sync push" in one_line_error(cli(*args))
        assert set(s3_keys(s3env, url)) == {WriterLease.NAME}
        assert not list((tmp_path / "gen").glob("batch-*.jsonl"))  # refused before the first batch
    cli(*args, check=True)
    assert cli("verify", url).returncode == 0
    assert not {WriterLease.NAME, EARLIER} & set(s3_keys(s3env, url))


def test_a_push_is_refused_while_generate_uploads_there(tmp_path, tiny_model_dir, s3env):
    """The other way round: while generate holds the prefix (between its batches), a push there is refused, so no
    artifact can be committed under generate's uploads."""
    from tests.generate.test_generate import prompts_file

    url = new_url("gen")
    src = prompts_file(tmp_path / "p.jsonl", 6)
    slow = ("import sys, time\nimport flashdraft.generate.stage as g\nreal = g.commit_batch\n"
            "def paced(*a, **k):\n    real(*a, **k)\n    time.sleep(3)\n"
            "g.commit_batch = paced\nfrom flashdraft.cli import app\napp(sys.argv[1:], prog_name='flashdraft')\n")
    gen = subprocess.Popen([sys.executable, "-c", slow, "generate", "--prompts", src, "--out", str(tmp_path / "gen"),
                            "--model", tiny_model_dir, "--max-new-tokens", "2", "--batch-size", "2",
                            "--upload-to", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while WriterLease.NAME not in s3_keys(s3env, url) and time.time() < deadline and gen.poll() is None:
        time.sleep(0.1)
    other = small_artifact(tmp_path / "other", kind="files")
    proc = run_cli("sync", "push", str(other), url, timeout=60)
    out, err = gen.communicate(timeout=180)
    assert "being written by flashdraft generate --upload-to" in one_line_error(proc)
    assert gen.returncode == 0, err
    assert run_cli("verify", url).returncode == 0


def test_an_interrupted_re_push_leaves_an_owner_that_another_directory_cannot_take(cli, tmp_path, s3env):
    """A re-push withdrew its manifest and was killed: the prefix has files and no manifest. Another user's
    directory pushed there with --delete is refused (the first user's files stay); the first user's rerun resumes."""
    from flashdraft.artifact.prefix import open_for_writing

    url = new_url()
    mine = small_artifact(tmp_path / "mine", kind="dataset", files=3)
    cli("sync", "push", str(mine), url, check=True)
    open_for_writing(open_store(url), "dataset", read_manifest(mine).lineage)  # what a killed re-push left
    assert MANIFEST not in s3_keys(s3env, url)
    theirs = small_artifact(tmp_path / "theirs", kind="files", files=2)
    refused = cli("sync", "push", str(theirs), url, "--delete")
    assert "interrupted push of a dataset artifact" in one_line_error(refused)
    assert {f"part-{i}.bin" for i in range(3)} <= set(s3_keys(s3env, url))
    cli("sync", "push", str(mine), url, check=True)
    assert cli("verify", url).returncode == 0 and EARLIER not in s3_keys(s3env, url)


def test_a_push_never_writes_into_its_source(cli, tmp_path, s3env):
    """A push and its no-op rerun leave the source byte for byte as it was (no ETag memo beside the files)."""
    src = small_artifact(tmp_path / "src", kind="dataset")
    before = tree_digest(src)
    url = new_url()
    cli("sync", "push", str(src), url, check=True)
    again = cli("sync", "push", str(src), url, check=True)
    assert "already done, verified" in again.stdout + again.stderr
    assert tree_digest(src) == before and sorted(os.listdir(src)) == sorted(before)


@pytest.mark.skipif(not can_unshare("--mount"), reason="needs `unshare --mount` for a read-only bind mount")
@pytest.mark.parametrize("kind", ["dataset", "plain directory"])
def test_a_push_from_a_read_only_source_commits_and_reruns(tmp_path, s3env, kind):
    src = tmp_path / "src"
    if kind == "plain directory":
        src.mkdir()
        (src / "a.txt").write_text("a colleague's notes\n")
    else:
        small_artifact(src, kind=kind)
    mount, url = tmp_path / "ro", new_url()
    mount.mkdir()
    # Quoted: a clone's path may hold a space (CI runs from `…/ci clone/flashdraft`).
    q = shlex.quote
    script = (f"mount --bind -o ro {q(str(src))} {q(str(mount))} && for i in 1 2; do {q(sys.executable)} -m flashdraft "
              f"sync push {q(str(mount))} {q(url)} || exit 1; done")
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # the push and its rerun
    assert "already done, verified" in proc.stdout + proc.stderr
    assert run_cli("verify", url).returncode == 0


# ---------------------------------------------------------------------------------------------- endpoints


@contextmanager
def http_server(handler_body, host: str = "127.0.0.1"):
    """A loopback HTTP server whose GET runs `handler_body(handler)`; yields (base URL, the requests it saw)."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
            handler_body(self)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{host}:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


def answer_models(handler, auth: str | None = None) -> None:
    if auth is not None and handler.headers.get("Authorization") != auth:
        handler.send_response(401)
        handler.end_headers()
        return
    body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_preflight_never_follows_a_redirect_to_another_origin_with_the_api_key(monkeypatch):
    from flashdraft.preflight import check_endpoint

    key = "sk-flashdraft-redirect-0123456789"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    with http_server(answer_models, host="127.0.0.2") as (elsewhere, seen_elsewhere):
        def redirect(handler):
            handler.send_response(302)
            handler.send_header("Location", f"{elsewhere}/v1/models")
            handler.send_header("Content-Length", "0")
            handler.end_headers()

        with http_server(redirect) as (base, seen):
            check = check_endpoint(f"{base}/v1", "m")
    assert not check.ok and "redirect to another origin (http://127.0.0.2:" in check.detail
    assert seen[0]["authorization"] == f"Bearer {key}" and seen_elsewhere == []
    assert key not in check.line()


def test_preflight_sends_basic_auth_from_the_url_and_bounds_a_slow_endpoint(monkeypatch):
    from flashdraft.preflight import ENDPOINT_TIMEOUT_S, check_endpoint

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with http_server(lambda h: answer_models(h, auth="Basic dXNlcjpwdw==")) as (base, seen):
        host = base.removeprefix("http://")
        check = check_endpoint(f"http://user:pw@{host}/v1", "m")
    assert check.ok, check.detail
    assert seen[0]["authorization"] == "Basic dXNlcjpwdw==" and "pw" not in check.line()

    def drip(handler):  # headers at once, then one byte of the body every 2 s
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(60):
            try:
                handler.wfile.write(b" ")
                handler.wfile.flush()
            except OSError:
                return
            time.sleep(2)

    with http_server(drip) as (base, _):
        started = time.monotonic()
        check = check_endpoint(f"{base}/v1", "m")
    assert not check.ok and time.monotonic() - started < ENDPOINT_TIMEOUT_S + 3


# ---------------------------------------------------------------------------------------------- hangs


def test_a_fifo_at_a_lock_path_or_as_an_eval_set_never_hangs_a_command(cli, tmp_path):
    workdir = tmp_path / "work"
    (workdir / "generate").mkdir(parents=True)
    os.mkfifo(workdir / ".flashdraft-lock-generate")
    config = tmp_path / "c.yaml"
    config.write_text(f"workdir: {workdir}\n")
    status = cli("status", "--config", str(config), "--json", timeout=60)
    assert status.returncode in (0, 1) and "Traceback" not in status.stderr
    fifo = tmp_path / "gsm8k.jsonl"
    os.mkfifo(fifo)
    for path, what in [(fifo, "is a FIFO"), ("/dev/zero", "is a device")]:
        config.write_text(f"workdir: {workdir}\neval:\n  prompts: gsm8k={path}\n")
        dry = cli("run", str(config), "--from", "eval", "--dry-run", timeout=60)
        assert dry.returncode == 1 and what in dry.stdout + dry.stderr and "Traceback" not in dry.stderr


def test_a_line_longer_than_any_record_is_rejected_without_being_held(tmp_path, monkeypatch):
    import flashdraft.records as records
    from flashdraft.generate.prompts import load_prompts

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1024)
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n' + b"x" * 5000 + b"\n" + b'{"prompt": "also fine"}\n')
    loaded = load_prompts(str(path))
    assert len(loaded.prompts) == 2 and [(r.line, r.reason) for r in loaded.rejected] == [(2, "line longer than 0 MB")]


# ---------------------------------------------------------------------------------------------- what a dry run writes


@pytest.mark.slow
def test_a_dry_run_converts_nothing_into_the_model_cache(cli, tmp_path):
    cache = tmp_path / "cache"
    config = tmp_path / "c.yaml"
    config.write_text(f"workdir: {tmp_path / 'work'}\n")
    proc = cli("run", str(config), "--dry-run", timeout=300, env=dict(os.environ, FLASHDRAFT_CACHE=str(cache)))
    assert "disk at" in proc.stdout + proc.stderr, proc.stderr
    assert not cache.exists() or not any(cache.rglob("*")), list(cache.rglob("*"))
    assert not (tmp_path / "work").exists()


# ---------------------------------------------------------------------------------------------- crafted records


def test_an_owner_marker_of_the_wrong_shape_is_no_progress_not_a_traceback(cli, tmp_path):
    workdir = tmp_path / "work"
    (workdir / "generate").mkdir(parents=True)
    (workdir / "generate" / ".flashdraft-owner.json").write_text(json.dumps({"kind": "completions",
                                                                             "batches": "53", "started": 7}))
    (workdir / "generate" / "batch-000000.jsonl").write_text("{}\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"workdir: {workdir}\n")
    proc = cli("status", "--config", str(config), "--json", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    generate = next(row for row in json.loads(proc.stdout)["stages"] if row["stage"] == "generate")
    assert generate["progress"]["state"] == "interrupted" and "total" not in generate["progress"]


def test_static_decoding_past_the_targets_context_is_one_line(cli, tmp_path, tiny_model_dir):
    import torch

    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.export import save_drafter
    from flashdraft.model.target import Target

    target = Target(tiny_model_dir, "cpu", lambda line: None)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(draft_config(target.config, num_layers=1, block_size=4, mask_token_id=0)),
                 tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi?"}) + "\n")
    proc = cli("eval", "--drafter", str(tmp_path / "drafter"), "--target", tiny_model_dir, "--prompts", str(prompts),
               "--out", str(tmp_path / "eval"), "--decoding", "static", "--max-new-tokens", "2000000000", timeout=300)
    assert "past the target's context" in one_line_error(proc)


def test_eval_set_records_are_formatted_only_from_strings_and_in_either_mt_bench_schema(tmp_path):
    from flashdraft.evaluate.sets import load_standard

    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps(r) + "\n" for r in [{"question": "1+1?", "answer": "2"}, {"question": None},
                                                           {"question": {"text": "x"}}, {"question": 3}]))
    loaded = load_standard("gsm8k", str(gsm8k))
    assert len(loaded.prompts) == 1
    assert [r.reason for r in loaded.rejected] == ["gsm8k: `question` is null, not a string",
                                                   "gsm8k: `question` is an object, not a string",
                                                   "gsm8k: `question` is a number, not a string"]
    fastchat = tmp_path / "question.jsonl"  # FastChat's own file, as SpecForge's and SGLang's benchmarks read it
    h4 = tmp_path / "mt_bench_prompts.jsonl"  # HuggingFaceH4's copy: the same, with `turns` renamed `prompt`
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}]
    fastchat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    h4.write_text("".join(json.dumps({"prompt": r["turns"], "category": r["category"]}) + "\n" for r in rows))
    a, b = load_standard("mt-bench", str(fastchat)), load_standard("mt-bench", str(h4))
    assert not a.rejected and [(p.prompt, p.follow_ups) for p in a.prompts] == [(p.prompt, p.follow_ups)
                                                                               for p in b.prompts]
    mbpp_full = tmp_path / "mbpp.jsonl"
    mbpp_full.write_text(json.dumps({"task_id": 11, "text": "Write a function.", "code": "", "test_list": []}) + "\n")
    assert "MBPP's full configuration" in load_standard("mbpp", str(mbpp_full)).rejected[0].reason


def test_the_demo_heartbeat_eta_comes_from_the_stages_pace_and_says_when_it_is_the_plan():
    import flashdraft.progress as progress
    from flashdraft.demo import eta_text

    stages = [("generate", "", 60.0), ("train", "", 120.0), ("eval", "", 30.0)]
    assert eta_text(stages, 1, 10.0) == "ETA ≈ 2 min 20 s (the plan's estimate: this stage has no pace yet)"
    assert "past its plan" in eta_text(stages, 1, 600.0)
    with progress.progress(None, "train", total=100) as update:
        progress.current.t0 -= 600  # 10 of 100 steps in ten minutes: 90 minutes to go, whatever the plan said
        update(advance=10)
        text = eta_text(stages, 1, 600.0)
    assert text.startswith("ETA ≈ 90 min") and "at its own pace + the plan for 1 more" in text
    assert progress.current is None

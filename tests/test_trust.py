"""Trust: each way a careless user, a second machine or a hostile store writer broke an earlier flashdraft, as it
was reproduced — real CLI processes, real files, SeaweedFS. Each asserts that nothing outside the destination
changed, that no payload ran, that no mixed artifact verifies, and that the refusal is one line."""

import json
import os
import resource
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from flashdraft.artifact.manifest import MANIFEST, build_manifest, read_manifest, verify_dir, write_manifest
from tests.artifact.test_ownership import tree_digest, users_dir
from tests.forked_cli import run_cli, run_cli_together

FLASHDRAFT = [sys.executable, "-m", "flashdraft"]


def one_line_error(proc) -> str:
    """The refusal: exit 1, one `error:` line, no traceback."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def conversations(path: Path, n: int = 4) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": f"Answer number {i}, with a few more words."}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tokenize_args(src: Path, out: Path, tokenizer: str, *extra: str) -> list[str]:
    return ["tokenize", "--input", str(src), "--out", str(out), "--tokenizer", tokenizer, "--workers", "1",
            "--min-loss-fraction", "0", *extra]


# ---------------------------------------------------------------------------------------------- no pickle


class Payload:
    """What a hostile writer plants: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def train_config(path: Path, target: str, **train) -> Path:
    import yaml

    base = dict(target=target, num_layers=2, block_size=8, max_anchors=8, lr=3e-3, eval_samples=2,
                mask_token_id=127, batch_size=2, checkpoint_every=2)
    path.write_text(yaml.safe_dump({"train": {**base, **train}}))
    return path


def test_a_checkpoint_planted_in_the_store_never_runs_code(cli, tmp_path, tiny_target, tiny_dataset):
    config = train_config(tmp_path / "c.yaml", tiny_target, max_steps=4)
    store = tmp_path / "store"
    train = ["train", "--config", str(config), "--data", str(tiny_dataset), "--push-to", str(store)]
    cli(*train, "--out", str(tmp_path / "first"), check=True)
    real = store / "checkpoints" / "step-0000004"
    assert sorted(p.name for p in real.iterdir()) == sorted([MANIFEST, "drafter.safetensors", "optimizer.safetensors",
                                                             "position.json", "trainer_state.json"])  # no pickle

    # A hostile writer copies a real checkpoint, adds a pickle with a payload, copies the lineage, and commits it
    # as the newest checkpoint; first beside the safetensors state, then as the only optimizer state.
    marker = tmp_path / "PAYLOAD-RAN"
    planted = store / "checkpoints" / "step-0000009"
    for drop_state in (False, True):
        import shutil

        shutil.rmtree(planted, ignore_errors=True)
        shutil.copytree(real, planted)
        torch.save({"optimizer": Payload(marker), "scheduler": {}}, planted / "optimizer.pt")
        if drop_state:
            (planted / "optimizer.safetensors").unlink()
        position = json.loads((planted / "position.json").read_text())  # the step its new name says
        (planted / "position.json").write_text(json.dumps({**position, "step": 9}))
        (planted / MANIFEST).unlink()
        write_manifest(planted, build_manifest(planted, kind="checkpoint", stats=read_manifest(real).stats,
                                               lineage=read_manifest(real).lineage))
        node = tmp_path / f"replacement-{drop_state}"
        proc = cli(*train, "--out", str(node))
        assert not marker.exists(), "the planted payload ran"
        if drop_state:
            assert "optimizer.pt is not a plain optimizer state" in one_line_error(proc)
            assert "done, verified" not in proc.stdout + proc.stderr
        else:  # the pickle is never opened: the state comes from safetensors
            assert proc.returncode == 0 and "resuming from step-0000009" in proc.stdout


# ---------------------------------------------------------------------------------------------- own --out


def test_stages_refuse_an_out_they_do_not_own_and_change_nothing(cli, tmp_path, smollm2_dir):
    src = conversations(tmp_path / "conversations.jsonl")
    thesis = users_dir(tmp_path / "thesis")
    before = tree_digest(tmp_path)
    line = one_line_error(cli(*tokenize_args(src, thesis, smollm2_dir)))
    assert "thesis.tex" in line and "nothing was changed" in line
    assert tree_digest(tmp_path) == before  # nothing outside or inside the refused --out changed

    # tokenize's own input given as its output: a completions artifact is not a dataset
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "batch-000000.jsonl").write_text(src.read_text())
    write_manifest(gen, build_manifest(gen, kind="completions"))
    before = tree_digest(tmp_path)
    line = one_line_error(cli(*tokenize_args(gen, gen, smollm2_dir)))
    assert f"--out {gen} is the input {gen}" in line and tree_digest(tmp_path) == before

    # its own dataset is rebuilt in place, old files replaced as its manifest names them
    dataset = tmp_path / "dataset"
    cli(*tokenize_args(src, dataset, smollm2_dir), check=True)
    cli(*tokenize_args(src, dataset, smollm2_dir, "--max-length", "40"), check=True)
    assert verify_dir(dataset) == [] and read_manifest(dataset).stats["truncated"] > 0

    # eval does not describe (or replace) files that are not its own
    with_notes = users_dir(tmp_path / "eval-out")
    drafter = tmp_path / "no-drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "block_size": 4}')
    before = tree_digest(tmp_path)
    line = one_line_error(cli("eval", "--drafter", str(drafter), "--out", str(with_notes), "--target", smollm2_dir))
    assert "not empty" in line and tree_digest(tmp_path) == before


def test_a_manifest_entry_never_deletes_a_file_outside_out(cli, tmp_path, tiny_model_dir):
    from tests.generate.test_generate import prompts_file

    src = prompts_file(tmp_path / "p.jsonl", 3)
    out = tmp_path / "gen"
    args = ["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--max-new-tokens", "2"]
    cli(*args, check=True)
    victims = [tmp_path / "victim-relative.txt", tmp_path / "victim-absolute.txt"]
    for victim in victims:
        victim.write_text("someone else's")
    manifest = json.loads((out / MANIFEST).read_text())
    entry = manifest["files"][0]
    manifest["files"] += [{**entry, "path": "../victim-relative.txt"}, {**entry, "path": str(victims[1])}]
    (out / MANIFEST).write_text(json.dumps(manifest))  # right lineage, hostile entries
    cli(*args, check=True)  # reopened (it no longer verifies) and finished again
    assert all(v.read_text() == "someone else's" for v in victims) and verify_dir(out) == []


# ---------------------------------------------------------------------------------------------- store owners


def test_a_store_prefix_has_an_owner(cli, tmp_path, s3env):
    url = f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}/art"
    first = tmp_path / "first"
    first.mkdir()
    (first / "a.bin").write_bytes(os.urandom(2000))
    write_manifest(first, build_manifest(first, kind="dataset"))
    cli("sync", "push", str(first), url, check=True)
    before = {o["Key"]: o["ETag"] for o in s3env.client().list_objects_v2(
        Bucket="flashdraft", Prefix=url[len("s3://flashdraft/"):])["Contents"]}

    other = tmp_path / "other"
    other.mkdir()
    (other / "a.bin").write_bytes(os.urandom(2000))  # same name, other bytes: would overwrite
    write_manifest(other, build_manifest(other, kind="eval"))
    line = one_line_error(cli("sync", "push", str(other), url))
    assert "holds a dataset artifact" in line and "nothing was written" in line and "--force" in line
    after = {o["Key"]: o["ETag"] for o in s3env.client().list_objects_v2(
        Bucket="flashdraft", Prefix=url[len("s3://flashdraft/"):])["Contents"]}
    assert after == before and cli("verify", url).returncode == 0

    forced = cli("sync", "push", str(other), url, "--force", check=True)
    assert "replacing a dataset artifact" in forced.stdout and cli("verify", url).returncode == 0


def test_two_pushes_to_one_prefix_never_leave_a_mixed_artifact_that_verifies(tmp_path, s3env):
    """Two machines push different versions of one plain directory (same kind, same empty lineage: neither is
    refused up front) to one prefix at the same moment, five times: whatever is left there either verifies as
    exactly one of the two, or does not verify — never a mix that verifies."""
    sources = []
    for name in ("a", "b"):
        src = tmp_path / name
        src.mkdir()
        for i in range(6):
            (src / f"part-{i}.bin").write_bytes(os.urandom(50_000))
        write_manifest(src, build_manifest(src))
        sources.append(src)
    for attempt in range(5):
        url = f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}/art-{attempt}"
        # fresh interpreters, not run_cli_together: see test_edges.py's race of two pushes
        procs = [subprocess.Popen([*FLASHDRAFT, "sync", "push", str(src), url], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for src in sources]
        results = [(p.wait(), *p.communicate()) for p in procs]
        assert all("Traceback" not in err for _, _, err in results), results
        verified = run_cli("verify", url).returncode == 0
        raw = s3env.client().get_object(Bucket="flashdraft", Key=url[len("s3://flashdraft/"):] + "/" + MANIFEST)[
            "Body"].read() if verified else None
        if verified:
            assert raw in {(src / MANIFEST).read_bytes() for src in sources}
            winner = next(src for src in sources if (src / MANIFEST).read_bytes() == raw)
            assert results[sources.index(winner)][0] == 0  # the one that verifies is the one that said so


def test_a_second_training_run_cannot_take_over_the_first_ones_push_to(cli, tmp_path, tiny_target, tiny_dataset):
    store = tmp_path / "store"
    first = train_config(tmp_path / "first.yaml", tiny_target, max_steps=4)
    cli("train", "--config", str(first), "--data", str(tiny_dataset), "--out", str(tmp_path / "a"), "--push-to",
        str(store), check=True)
    before = tree_digest(store)
    second = train_config(tmp_path / "second.yaml", tiny_target, max_steps=4, lr=1e-3)  # other settings
    proc = cli("train", "--config", str(second), "--data", str(tiny_dataset), "--out", str(tmp_path / "b"),
               "--push-to", str(store))
    assert "trained from other data or settings" in one_line_error(proc) and "--push-to" in proc.stderr
    assert tree_digest(store) == before


def test_generate_never_uploads_batches_under_a_live_manifest(cli, tmp_path, tiny_model_dir, s3env):
    from flashdraft.artifact.prefix import EARLIER, PrefixOwned, open_for_writing
    from flashdraft.artifact.store import open_store
    from flashdraft.config import GenerateConfig
    from flashdraft.generate.stage import lineage_for
    from tests.generate.test_generate import prompts_file

    url = f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}/gen"
    src = prompts_file(tmp_path / "p.jsonl", 4)
    out = tmp_path / "gen"
    args = ["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--max-new-tokens", "2",
            "--batch-size", "2", "--upload-to", url]
    cli(*args, check=True)
    store = open_store(url)
    mine = lineage_for(GenerateConfig(prompts=src, model=tiny_model_dir, max_new_tokens=2, batch_size=2))
    assert read_manifest(out).lineage.same_work(mine)
    with pytest.raises(PrefixOwned, match="completions artifact made from other settings"):
        open_for_writing(store, "completions", mine.model_copy(update={"config": "other"}))
    assert MANIFEST in store.list()  # refused: nothing written
    open_for_writing(store, "completions", mine)  # what a rerun does before its first batch upload
    assert MANIFEST not in store.list() and store.read_bytes(EARLIER) is not None

    (out / "batch-000001.jsonl").unlink()  # this host regenerates one batch, uploads it, then commits again
    cli(*args, check=True)
    assert cli("verify", url).returncode == 0


# ---------------------------------------------------------------------------------------------- one writer


def test_two_generate_runs_on_one_out_never_mix(tmp_path, tiny_model_dir):
    """Started together with different settings, five times: one run owns --out, the other is refused at once
    (locked, naming its holder) or, when it comes second, by lineage; the artifact holds one run's records."""
    from tests.generate.test_generate import prompts_file

    src = prompts_file(tmp_path / "p.jsonl", 4)
    for attempt in range(5):
        out = tmp_path / f"gen-{attempt}"
        results = [(r.returncode, r.stdout, r.stderr) for r in run_cli_together(
            *(["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--batch-size", "1",
               "--max-new-tokens", str(tokens)] for tokens in (2, 3)))]
        codes = sorted(code for code, _, _ in results)
        assert codes == [0, 1], results
        loser = next(err for code, _, err in results if code == 1)
        assert "Traceback" not in loser and ("is in use by flashdraft generate" in loser
                                             or "different prompts or settings" in loser)
        assert verify_dir(out) == []
        rows = [json.loads(line) for f in sorted(out.glob("batch-*[0-9].jsonl")) for line in f.read_text().splitlines()]
        assert len(rows) == 4 and len({r["sampling"]["max_new_tokens"] for r in rows}) == 1


def test_a_concurrent_tokenize_never_reports_a_dataset_that_does_not_verify(tmp_path, smollm2_dir):
    src = conversations(tmp_path / "c.jsonl", 40)
    for attempt in range(3):
        out = tmp_path / f"ds-{attempt}"
        results = [(r.returncode, r.stdout, r.stderr) for r in run_cli_together(
            *(tokenize_args(src, out, smollm2_dir) for _ in range(2)))]
        assert verify_dir(out) == [] and read_manifest(out).stats["samples"] == 40
        for code, _, stderr in results:
            assert "Traceback" not in stderr
            assert code == 0 or "is in use by flashdraft tokenize" in stderr


def test_two_trainings_on_one_out_never_share_it(tmp_path, tiny_target, tiny_dataset):
    out = tmp_path / "out"
    config = train_config(tmp_path / "c.yaml", tiny_target, max_steps=6)
    results = [(r.returncode, r.stdout, r.stderr) for r in run_cli_together(
        *(["train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(out)] for _ in range(2)))]
    assert all("Traceback" not in err for _, _, err in results)
    refused = [err for code, _, err in results if code != 0]
    assert all("is in use by flashdraft train" in err for err in refused)
    steps = [json.loads(m)["step"] for m in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in m]
    assert steps == sorted(set(steps)) == list(range(1, 7))  # every metric once: one writer
    assert verify_dir(out / "drafter") == []


# ---------------------------------------------------------------------------------------------- failures


def test_a_tokenizer_the_workers_cannot_load_ends_the_run_with_one_line(cli, tmp_path, tiny_target):
    src = conversations(tmp_path / "c.jsonl")
    proc = cli("tokenize", "--input", str(src), "--out", str(tmp_path / "ds"), "--tokenizer", tiny_target,
               "--workers", "2", timeout=120)  # a weights directory without tokenizer.json; it used to hang
    assert tiny_target in one_line_error(proc) and not (tmp_path / "ds").exists()


def test_a_failing_checkpoint_push_stops_training_at_once(cli, tmp_path, tiny_target, tiny_dataset):
    store = tmp_path / "store"
    store.mkdir()
    (store / "checkpoints").write_text("a file where the checkpoints' folder would go: every push fails")
    config = train_config(tmp_path / "c.yaml", tiny_target, max_steps=200, push_attempts=2, keep_checkpoints=1)
    out = tmp_path / "out"
    proc = cli("train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(out), "--push-to",
               str(store), env={**os.environ, "FLASHDRAFT_PUSH_BACKOFF_S": "0.05"})
    line = one_line_error(proc)
    assert "step-0000002 could not be pushed" in line and "after 2 attempt(s)" in line
    assert "push of checkpoints/step-0000002 failed (attempt 1 of 2)" in proc.stdout  # logged when it happened
    steps = [json.loads(m)["step"] for m in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in m]
    assert max(steps) < 200  # stopped when the push failed, not at the end
    assert (out / "checkpoints" / "step-0000002").is_dir()  # never pushed, so never pruned


def test_a_disk_that_refuses_a_checkpoint_write_is_one_line(cli, tmp_path, tiny_target, tiny_dataset):
    def small_files():  # in the child: files may not grow past 64 KB, and the write fails instead of killing it
        resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    config = train_config(tmp_path / "c.yaml", tiny_target, max_steps=2)
    proc = subprocess.run([*FLASHDRAFT, "train", "--config", str(config), "--data", str(tiny_dataset), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, preexec_fn=small_files)
    assert "cannot write" in one_line_error(proc)
    assert not list((tmp_path / "out").glob("checkpoints/step-*"))  # nothing half-written a resume would trust


def test_credentials_in_urls_are_never_printed_or_written(cli, tmp_path, s3env):
    from tests.generate.test_generate import _free_port, prompts_file

    secret = "pa55word-never-shown"
    proc = cli("verify", f"s3://alice:{secret}@flashdraft/x")
    assert "***@" in one_line_error(proc) and secret not in proc.stdout + proc.stderr

    port = _free_port()
    gen = cli("generate", "--prompts", prompts_file(tmp_path / "p.jsonl", 2), "--out", str(tmp_path / "gen"),
              "--backend", "openai", "--base-url", f"http://bob:{secret}@127.0.0.1:{port}/v1")
    assert gen.returncode == 1 and secret not in gen.stdout + gen.stderr
    assert all(secret not in p.read_text() for p in (tmp_path / "gen").rglob("*") if p.is_file())

    status = cli("status", "--store", f"s3://carol:{secret}@flashdraft/run", cwd=tmp_path)
    assert secret not in status.stdout + status.stderr
    assert not (tmp_path / "flashdraft-work" / "STATUS.md").exists() or secret not in (
        tmp_path / "flashdraft-work" / "STATUS.md").read_text()


def test_status_shows_a_reason_with_brackets_as_it_is(cli, tmp_path, s3env):
    proc = cli("status", "--store", "s3://bad[/x]bucket/run", "--json", "--markdown", "STATUS.md", cwd=tmp_path)
    assert "Traceback" not in proc.stderr and "MarkupError" not in proc.stderr
    rows = json.loads(proc.stdout)["stages"]
    assert any("[/x]" in row["artifact"] and not row["verified"] for row in rows if row["where"] == "store")
    assert "[/x]" in (tmp_path / "STATUS.md").read_text()


def test_status_is_read_only_in_an_empty_directory(cli, tmp_path):
    """Issue 56: a read-only command writes nothing — no flashdraft-work/, no STATUS.md — unless asked for a file."""
    (tmp_path / "empty").mkdir()
    proc = cli("status", cwd=tmp_path / "empty")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list((tmp_path / "empty").iterdir()) == []
    cli("status", "--markdown", "table.md", cwd=tmp_path / "empty", check=True)
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["table.md"]


def test_status_tells_a_store_it_cannot_check_from_one_that_does_not_verify(cli, tmp_path, s3env, monkeypatch):
    """Issue 56: no credentials is "cannot check" (exit 1, one line), not "NOT verified" with exit 0; a store row
    whose artifact is not there shows no stats (the local copy's are not the store's)."""
    from flashdraft.artifact.manifest import build_manifest, write_manifest
    from tests.train.test_train import make_dataset

    work = tmp_path / "work" / "dataset"
    make_dataset(work, [[1, 2, 3, 4, 5, 6]])
    write_manifest(work, build_manifest(work, kind="dataset", stats={"samples": 1, "tokens": 6}))
    config = tmp_path / "c.yaml"
    config.write_text(f"workdir: {tmp_path / 'work'}\n")
    store = "s3://flashdraft/status-run"
    report = json.loads(cli("status", "--config", str(config), "--store", store, "--json", check=True).stdout)
    rows = {(r["stage"], r["where"]): r for r in report["stages"]}
    assert rows[("tokenize", "local")]["verified"] and rows[("tokenize", "local")]["stats"]["samples"] == 1
    absent = rows[("tokenize", "store")]
    assert absent["verified"] is False and absent["stats"] == {} and "not there" in absent["reason"]

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    proc = cli("status", "--config", str(config), "--store", store, "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "could not be checked" in proc.stderr and "no credentials" in proc.stderr
    stored = [r for r in json.loads(proc.stdout)["stages"] if r["where"] == "store"]
    assert stored and all(r["verified"] is None and r["reason"].startswith("cannot check") for r in stored)

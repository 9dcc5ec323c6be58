"""Bad and edge input, as a user (or a failing fleet) gives it: every case is a clear one-line error with a
non-zero exit, or correct behaviour — never "done, verified" of empty, failed or corrupt work (issue 19).

Each case runs the real CLI in a subprocess and checks the exit code, that the single `error:` line names the
cause, that no manifest appears for failed or empty work, and that nothing outside the destination changed.
"""

import json
import os
import shutil
import socket
import uuid
from pathlib import Path

import pytest
import yaml

from flashdraft.artifact.manifest import MANIFEST, build_manifest, read_manifest, verify_dir, write_manifest


def failed_cleanly(proc, *needles: str) -> str:
    """Exit 1, one `error:` line on stderr naming every needle, no traceback, no success claimed."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "done, verified" not in proc.stdout + proc.stderr
    return lines[0]


def write_prompts(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def flip_byte(path: Path, at: int = -20) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once closed


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A finished tiny pipeline (completions, dataset, drafter, eval) that tests copy and then damage."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("finished")
    config = {
        "workdir": str(root / "work"),
        "generate": {"model": tiny_model_dir, "max_prompts": 12, "max_new_tokens": 24, "batch_size": 6},
        "tokenize": {"tokenizer": tiny_model_dir, "min_loss_fraction": 0.05, "workers": 1},
        "train": {"target": tiny_model_dir, "num_layers": 1, "block_size": 8, "max_anchors": 8, "epochs": 1,
                  "batch_size": 2, "eval_samples": 2, "checkpoint_every": 100},
        "eval": {"target": tiny_model_dir, "max_prompts": 2, "max_new_tokens": 8},
    }
    (root / "c.yaml").write_text(yaml.safe_dump(config))
    subprocess.run([sys.executable, "-m", "flashdraft", "run", str(root / "c.yaml")], check=True, capture_output=True)
    return root / "work"


def copy_of(finished: Path, name: str, tmp_path: Path) -> Path:
    shutil.copytree(finished / name, tmp_path / Path(name).name)
    return tmp_path / Path(name).name


# ------------------------------------------------------------------------------------------- empty input


@pytest.mark.parametrize("lines", [[], ["", "   "], ['{"messages": []}', "not json", '{"prompt": ""}']])
def test_generate_with_no_usable_prompt_is_not_done(cli, tmp_path, lines):
    src = write_prompts(tmp_path / "p.jsonl", lines)
    out = tmp_path / "gen"
    failed_cleanly(cli("generate", "--prompts", src, "--out", str(out)), "no prompts in", "nothing to generate")
    assert not (out / MANIFEST).exists()
    assert len((out / "rejected.jsonl").read_text().splitlines()) == len([x for x in lines if x.strip()])


def test_eval_with_no_usable_prompt_is_not_done(cli, tmp_path, finished):
    src = write_prompts(tmp_path / "p.jsonl", ["", "{}"])
    out = tmp_path / "eval"
    failed_cleanly(cli("eval", "--drafter", str(finished / "train" / "drafter"), "--prompts", src, "--out", str(out)),
                   "no usable prompts")
    assert not out.exists()


# ------------------------------------------------------------------------------------------- corrupt inputs


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_tokenize_refuses_a_generate_artifact_that_no_longer_verifies(cli, tmp_path, finished, damage):
    gen = copy_of(finished, "generate", tmp_path)
    batch = gen / "batch-000001.jsonl"
    if damage == "truncate":
        batch.write_bytes(batch.read_bytes()[:-30])
    else:
        flip_byte(batch)
    out = tmp_path / "ds"
    proc = cli("tokenize", "--input", str(gen), "--out", str(out), "--config", str(finished.parent / "c.yaml"))
    failed_cleanly(proc, "batch-000001.jsonl", "does not verify")
    assert not (out / MANIFEST).exists()


def test_tokenize_refuses_an_unfinished_generate_run(cli, tmp_path, finished):
    gen = copy_of(finished, "generate", tmp_path)
    (gen / MANIFEST).unlink()  # what a killed generate leaves: committed batches, no manifest
    failed_cleanly(cli("tokenize", "--input", str(gen), "--out", str(tmp_path / "ds"), "--config",
                       str(finished.parent / "c.yaml")), "unfinished generate run", "rerun `flashdraft generate`")


def test_train_refuses_a_dataset_that_no_longer_verifies(cli, tmp_path, finished):
    data = copy_of(finished, "dataset", tmp_path)
    flip_byte(next(data.glob("data-*.arrow")), at=-100)
    out = tmp_path / "train"
    failed_cleanly(cli("train", "--data", str(data), "--out", str(out), "--config", str(finished.parent / "c.yaml")),
                   "dataset", "data-00000-of-00001.arrow", "content differs")
    assert not (out / "drafter").exists()


def test_eval_refuses_a_drafter_that_no_longer_verifies(cli, tmp_path, finished):
    drafter = copy_of(finished, "train/drafter", tmp_path)
    flip_byte(drafter / "model.safetensors")
    out = tmp_path / "eval"
    failed_cleanly(cli("eval", "--drafter", str(drafter), "--out", str(out), "--config",
                       str(finished.parent / "c.yaml")), "model.safetensors", "does not verify")
    assert not (out / MANIFEST).exists()


def test_a_truncated_drafter_without_manifest_is_one_line(cli, tmp_path, finished):
    drafter = copy_of(finished, "train/drafter", tmp_path)
    (drafter / MANIFEST).unlink()  # a drafter from elsewhere: not verifiable, but loading it must not crash
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    failed_cleanly(cli("eval", "--drafter", str(drafter), "--out", str(tmp_path / "eval"), "--config",
                       str(finished.parent / "c.yaml")), "model.safetensors cannot be loaded")


def test_a_changed_committed_batch_is_named_on_resume(cli, tmp_path, tiny_model_dir):
    src = write_prompts(tmp_path / "p.jsonl", [json.dumps({"prompt": f"Say {i}."}) for i in range(4)])
    out = tmp_path / "gen"
    args = ["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--batch-size", "2",
            "--max-new-tokens", "2", "--config", str(write_config(tmp_path, generate={"max_error_fraction": 0}))]
    cli(*args, check=True)
    # What a killed run leaves (its in-progress claim, committed batches, no manifest), with a batch then damaged.
    (out / ".flashdraft-generate.json").write_text(read_manifest(out).lineage.model_dump_json())
    (out / MANIFEST).unlink()
    (out / "batch-000000.jsonl").write_text("{not json\n")
    failed_cleanly(cli(*args), "batch-000000.jsonl", "line 1 is not JSON")


def write_config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / f"{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(sections))
    return path


# ------------------------------------------------------------------------------------------- training


def test_a_dataset_from_another_tokenizer_is_refused(cli, tmp_path, finished, tiny_model_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    other = tmp_path / "other-target"  # the same weights, a tokenizer with one more token
    LlamaForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(other)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<flashdraft-extra>"])
    tokenizer.save_pretrained(other)
    out = tmp_path / "train"
    failed_cleanly(cli("train", "--data", str(finished / "dataset"), "--out", str(out), "--target", str(other),
                       "--config", str(finished.parent / "c.yaml")), "another tokenizer")
    assert not out.exists() or not (out / "drafter").exists()


@pytest.mark.parametrize("flags, named", [(["--epochs", "0"], "--epochs"), (["--epochs", "-1"], "--epochs"),
                                          (["--max-steps", "0"], "--max-steps")])
def test_training_settings_that_cannot_train_are_refused(cli, tmp_path, finished, flags, named):
    out = tmp_path / "train"
    failed_cleanly(cli("train", "--data", str(finished / "dataset"), "--out", str(out), *flags), named,
                   "greater than or equal to 1")
    assert not out.exists()


def test_a_negative_learning_rate_is_refused_naming_file_and_line(cli, tmp_path, finished):
    config = write_config(tmp_path, train={"lr": -1})
    failed_cleanly(cli("train", "--data", str(finished / "dataset"), "--out", str(tmp_path / "t"), "--config",
                       str(config)), f"{config}:2: train.lr", "greater than 0")


def test_a_tiny_dataset_trains_and_says_so(cli, tmp_path, tiny_target):
    from datasets import Dataset

    data = tmp_path / "ds"  # three samples: no held-out sample at all
    sequences = [list(range(5, 45)), list(range(10, 60)), list(range(20, 50))]
    Dataset.from_dict({"id": ["a", "b", "c"], "input_ids": sequences,
                       "loss_mask": [[0] * 4 + [1] * (len(s) - 4) for s in sequences],
                       "num_tokens": [len(s) for s in sequences]}).save_to_disk(str(data))
    write_manifest(data, build_manifest(data, kind="dataset"))
    config = write_config(tmp_path, train={"target": tiny_target, "num_layers": 1, "block_size": 8, "batch_size": 1,
                                           "epochs": 1, "mask_token_id": 127})
    proc = cli("train", "--data", str(data), "--out", str(tmp_path / "t"), "--config", str(config), check=True)
    assert "no held-out sample" in proc.stdout and verify_dir(tmp_path / "t" / "drafter") == []


def test_training_into_a_finished_out_with_other_settings_is_refused(cli, tmp_path, finished):
    out = copy_of(finished, "train", tmp_path)
    before = (out / "drafter" / "model.safetensors").read_bytes()
    proc = cli("train", "--data", str(finished / "dataset"), "--out", str(out), "--max-steps", "3", "--config",
               str(finished.parent / "c.yaml"))
    failed_cleanly(proc, "holds drafter trained from other", "another --out")
    assert (out / "drafter" / "model.safetensors").read_bytes() == before and verify_dir(out / "drafter") == []


def test_manifest_does_not_replace_a_stage_manifest(cli, finished, tmp_path):
    data = copy_of(finished, "dataset", tmp_path)
    before = (data / MANIFEST).read_bytes()
    failed_cleanly(cli("manifest", str(data)), "is a dataset artifact", "flashdraft verify")
    assert (data / MANIFEST).read_bytes() == before


# ------------------------------------------------------------------------------------------- object storage


@pytest.fixture
def prefix(s3env) -> str:
    return f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}"


def small_artifact(root: Path, names=("a.bin", "b.bin")) -> Path:
    root.mkdir(parents=True)
    for name in names:
        (root / name).write_bytes(os.urandom(100))
    write_manifest(root, build_manifest(root))
    return root


def test_push_to_a_bucket_root_is_refused(cli, tmp_path, s3env):
    art = small_artifact(tmp_path / "a")
    failed_cleanly(cli("sync", "push", str(art), "s3://flashdraft", "--delete"), "bucket root", "prefix")


def test_delete_never_removes_another_artifacts_objects(cli, tmp_path, prefix, s3env):
    other = small_artifact(tmp_path / "other")
    cli("sync", "push", str(other), f"{prefix}/other", check=True)
    mine = small_artifact(tmp_path / "mine", names=("c.bin",))
    proc = cli("sync", "push", str(mine), prefix, "--delete")  # the prefix holds another run's artifact
    assert proc.returncode == 1 and "no earlier manifest of this prefix" in proc.stderr
    assert cli("verify", f"{prefix}/other", check=True).returncode == 0


@pytest.mark.parametrize("command", [["verify", "s3://flashdraft/x"], ["sync", "pull", "s3://flashdraft/x", "DST"]])
def test_an_unreachable_store_is_one_line(cli, tmp_path, monkeypatch, command):
    port = closed_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "1")
    proc = cli(*[str(tmp_path / "dst") if a == "DST" else a for a in command], cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"cannot reach http://127.0.0.1:{port}" in proc.stderr + proc.stdout


def test_status_with_an_unreachable_store_reports_it_per_stage(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "1")
    proc = cli("status", "--store", "s3://flashdraft/x", "--json", cwd=tmp_path)
    report = json.loads(proc.stdout)  # a report, not a crash: each store row says why it is not verified
    store_rows = [r for r in report["stages"] if r["where"] == "store"]
    assert len(store_rows) == 4 and all("cannot reach" in r["reason"] for r in store_rows)
    assert not report["all_verified"] and "Traceback" not in proc.stderr


def test_generate_upload_to_an_unreachable_store_is_one_line(cli, tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "1")
    src = write_prompts(tmp_path / "p.jsonl", ['{"prompt": "Hi"}'])
    failed_cleanly(cli("generate", "--prompts", src, "--out", str(tmp_path / "g"), "--model", tiny_model_dir,
                       "--max-new-tokens", "2", "--upload-to", "s3://flashdraft/x/g"), "cannot reach")


def test_status_with_an_unsupported_store_url_is_one_line(cli, tmp_path):
    failed_cleanly(cli("status", "--store", "ftp://x", cwd=tmp_path), "unsupported store URL")


def test_a_link_out_of_the_artifact_is_not_followed(cli, tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    (tmp_path / "secret.txt").write_text("not part of the artifact")
    (art / "data.txt").symlink_to(tmp_path / "secret.txt")
    failed_cleanly(cli("sync", "push", str(art), str(tmp_path / "store")), "links outside the artifact")
    assert not (tmp_path / "store").exists()


def test_a_backslash_file_name_is_refused_before_it_is_described(cli, tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    (art / "a\\b.txt").write_text("x")
    failed_cleanly(cli("manifest", str(art)), "backslash")
    assert not (art / MANIFEST).exists()


# ------------------------------------------------------------------------------------------- the rest


@pytest.mark.parametrize("args, named", [
    (["generate", "--batch-size", "0"], "--batch-size"),
    (["generate", "--num-shards", "0"], "--num-shards"),
    (["generate", "--temperature", "-1"], "--temperature"),
    (["tokenize", "--min-loss-fraction", "2"], "--min-loss-fraction"),
    (["eval", "--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_flag_values_that_cannot_work_name_the_flag(cli, tmp_path, args, named):
    failed_cleanly(cli(*args, cwd=tmp_path), named)
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.parametrize("args, named", [(["--tokens-per-s", "0"], "--tokens-per-s"),
                                         (["--num-prompts", "-5"], "--num-prompts")])
def test_estimate_refuses_numbers_that_mean_nothing(cli, tmp_path, args, named):
    config = write_config(tmp_path, generate={"prompts": "builtin:demo"})
    failed_cleanly(cli("estimate", str(config), *args), named)


def test_estimate_with_a_target_config_that_is_not_json(cli, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    failed_cleanly(cli("estimate", str(write_config(tmp_path)), "--num-prompts", "10", "--target-config", str(bad)),
                   "is not a model's config.json")


def test_run_from_a_later_stage_than_until_is_refused(cli, tmp_path):
    failed_cleanly(cli("run", str(write_config(tmp_path)), "--from", "train", "--until", "tokenize"),
                   "--from train comes after --until tokenize")


def test_out_that_is_a_file_is_one_line(cli, tmp_path):
    out = tmp_path / "taken"
    out.write_text("a file, not a directory")
    src = write_prompts(tmp_path / "p.jsonl", ['{"prompt": "Hi"}'])
    failed_cleanly(cli("generate", "--prompts", src, "--out", str(out)))
    assert out.read_text() == "a file, not a directory"


def test_a_missing_model_path_is_named(cli, tmp_path):
    src = write_prompts(tmp_path / "p.jsonl", ['{"prompt": "Hi"}'])
    failed_cleanly(cli("generate", "--prompts", src, "--out", str(tmp_path / "g"), "--model", "/no/such/model"),
                   "generate model /no/such/model: not a directory, GGUF file or hub id")


def test_show_on_something_that_is_not_a_dataset(cli, tmp_path, tiny_model_dir):
    failed_cleanly(cli("tokenize", "--out", str(tmp_path), "--show", "1", "--tokenizer", tiny_model_dir))


def test_prompts_past_the_targets_context_are_rejected_with_the_reason(cli, tmp_path, tiny_model_dir):
    long_prompt = "word " * 2500  # the tiny target's context is 2,048 tokens
    src = write_prompts(tmp_path / "p.jsonl", [json.dumps({"prompt": long_prompt}), json.dumps({"prompt": "Hi"})])
    out = tmp_path / "gen"
    cli("generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--max-new-tokens", "2",
        check=True)
    assert read_manifest(out).stats["records"] == 1 and read_manifest(out).stats["rejected"] == 1
    rejected = json.loads((out / "rejected.jsonl").read_text())
    assert "exceeds the target's context of 2048 tokens" in rejected["reason"] and rejected["id"]


def test_exported_files_have_the_mode_the_umask_gives(finished):
    umask = os.umask(0)
    os.umask(umask)
    for path in (finished / "train" / "drafter").iterdir():  # safetensors alone would write 0600
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_a_server_that_never_answers_shows_its_retries_and_fails_within_the_timeout(cli, tmp_path):
    from tests.servers import failing_endpoint

    with failing_endpoint("m", "hang") as url:  # lists its model (preflight passes), then never answers a request
        config = write_config(tmp_path, generate={"max_retries": 1, "timeout_s": 1})
        src = write_prompts(tmp_path / "p.jsonl", ['{"prompt": "Hi"}'])
        proc = cli("generate", "--prompts", src, "--out", str(tmp_path / "g"), "--backend", "openai", "--model", "m",
                   "--base-url", url, "--config", str(config))
    failed_cleanly(proc, "1 of 1 requests failed", "Timeout")
    assert "request retries so far" in proc.stdout


def test_a_down_server_is_one_line_before_anything_is_written(cli, tmp_path):
    src = write_prompts(tmp_path / "p.jsonl", ['{"prompt": "Hi"}'])
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    failed_cleanly(cli("generate", "--prompts", src, "--out", str(tmp_path / "g"), "--backend", "openai",
                       "--base-url", dead), f"endpoint {dead}: does not answer", "nothing was started")
    assert not (tmp_path / "g").exists()


def test_a_server_that_dies_during_a_multipart_upload_is_one_error_naming_the_upload(tmp_path, s3env, monkeypatch):
    """The abort that follows a failed part cannot reach the dead server either; the error said is the upload's."""
    from flashdraft.artifact.store import StoreError, open_store
    from flashdraft.artifact.sync import push
    from tests.servers import TcpForwarder

    art = tmp_path / "big"
    art.mkdir()
    (art / "big.bin").write_bytes(os.urandom(24 << 20))
    dying = TcpForwarder(int(s3env.endpoint.rsplit(":", 1)[1]), die_after=8 << 20)  # mid-way through part 2
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{dying.port}")
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "1")
    with pytest.raises(StoreError) as failure:
        push(art, open_store(f"s3://flashdraft/t-{uuid.uuid4().hex[:8]}/big"), part_size=5 << 20, log=lambda s: None)
    message = str(failure.value)
    assert "upload big.bin" in message and "abort" not in message.lower()


def test_a_write_the_disk_refuses_is_one_line_and_leaves_no_manifest(tmp_path, tiny_model_dir):
    """A full disk, approximated by a file-size limit (writes past it fail with EFBIG, as ENOSPC would)."""
    import resource
    import signal
    import subprocess
    import sys

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    src = write_prompts(tmp_path / "p.jsonl", [json.dumps({"prompt": f"Tell me a long story number {i}."})
                                               for i in range(6)])
    out = tmp_path / "gen"
    proc = subprocess.run([sys.executable, "-m", "flashdraft", "generate", "--prompts", src, "--out", str(out),
                           "--model", tiny_model_dir, "--max-new-tokens", "64"],
                          capture_output=True, text=True, preexec_fn=small_files)
    failed_cleanly(proc, "File too large")
    assert not (out / MANIFEST).exists()


def test_one_conversation_goes_through_every_stage(cli, tmp_path, tiny_model_dir):
    """The smallest input is valid input: one prompt → one record → one sample → a trained drafter → a report."""
    src = write_prompts(tmp_path / "p.jsonl", [json.dumps({"prompt": "Describe the sea in one long sentence."})])
    config = write_config(tmp_path, workdir=str(tmp_path / "work"),
                          generate={"prompts": src, "model": tiny_model_dir, "max_new_tokens": 24},
                          tokenize={"tokenizer": tiny_model_dir, "min_loss_fraction": 0.05, "workers": 1},
                          train={"target": tiny_model_dir, "num_layers": 1, "block_size": 8, "epochs": 1},
                          eval={"target": tiny_model_dir, "prompts": src, "max_new_tokens": 8})
    cli("run", str(config), check=True)
    work = tmp_path / "work"
    assert read_manifest(work / "dataset").stats["samples"] == 1
    assert read_manifest(work / "train" / "drafter").stats["steps"] == 1
    assert read_manifest(work / "eval").stats["lossless"] is True


def test_tokenize_of_an_artifact_with_no_records_or_only_bad_ones_says_which(cli, tmp_path, smollm2_dir):
    """A generate artifact that holds nothing (every prompt skipped) and one whose only record is unusable: each is
    one line saying which, and no dataset."""
    empty, bad = tmp_path / "empty", tmp_path / "bad"
    for root in (empty, bad):
        root.mkdir()
    (bad / "batch-000000.jsonl").write_text(json.dumps({"id": "p0", "messages": [], "content": "x"}) + "\n")
    for root in (empty, bad):
        write_manifest(root, build_manifest(root, kind="completions"))
    said = failed_cleanly(cli("tokenize", "--input", str(empty), "--out", str(tmp_path / "a"), "--tokenizer",
                              smollm2_dir), "the input holds no records")
    assert "rejected" not in said and not (tmp_path / "a" / MANIFEST).exists()
    failed_cleanly(cli("tokenize", "--input", str(bad), "--out", str(tmp_path / "b"), "--tokenizer", smollm2_dir),
                   "every record was rejected (1 rejected)")
    assert not (tmp_path / "b" / MANIFEST).exists()


def test_a_bad_option_value_is_one_error_line_and_exit_1_with_its_json_object(cli, tmp_path):
    """Not the option library's box and exit 2: the README's promise for every expected failure."""
    bad = cli("train", "--max-steps", "abc", "--json")
    assert bad.returncode == 1
    assert json.loads(bad.stdout) == {"ok": False, "error": bad.stderr.strip().removeprefix("error: ")}
    assert bad.stderr.strip().splitlines() == [
        "error: Invalid value for '--max-steps': Input should be a valid integer, unable to parse string as an "
        "integer (flashdraft train --help)"]
    unknown = cli("train", "--max-stepz", "3")
    assert unknown.returncode == 1 and unknown.stdout == "" and unknown.stderr.strip().splitlines() == [
        "error: No such option: --max-stepz (Possible options: --max-steps) (flashdraft train --help)"]


def test_a_misspelt_key_names_the_key_it_is_closest_to(cli, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  lr: 0.001\n  max_step: 10\n")
    proc = cli("estimate", str(config), "--num-prompts", "10")
    assert proc.returncode == 1
    assert f"{config}:3: train.max_step: unknown key (did you mean train.max_steps?)" in proc.stderr
    config.write_text("train:\n  zzz: 1\n")
    assert "train.zzz: unknown key" in cli("estimate", str(config), "--num-prompts", "10").stderr
    assert "did you mean" not in cli("estimate", str(config), "--num-prompts", "10").stderr


@pytest.mark.parametrize("case", ["no credentials", "unreachable"])
def test_verify_says_it_cannot_check_a_store_it_cannot_ask(cli, tmp_path, monkeypatch, case):
    """No credentials, or no answer, is no verdict on the artifact: `cannot check`, as status says, not
    "NOT verified"; one line, exit 1, and with --json an object with ok false."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws either
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    if case == "unreachable":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    proc = cli("verify", "s3://flashdraft/x", "--json", cwd=tmp_path)
    assert proc.returncode == 1 and "NOT verified" not in proc.stderr + proc.stdout
    line = proc.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("error: verify: s3://flashdraft/x — cannot check"), line
    assert json.loads(proc.stdout)["ok"] is False


def test_an_eval_prompt_file_with_a_line_that_is_no_record_is_refused_naming_it(cli, tmp_path, tiny_model_dir):
    """One good line and one that is not JSON: eval exits 1 naming line 2 (half a file must not go missing with exit
    0); --skip-unreadable measures the good one and writes the other to rejected.jsonl with its reason."""
    from tests.evaluate.test_sets import random_drafter

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me about owls."}) + "\n" + '{"prompt": "unterminated\n')
    random_drafter(tiny_model_dir, tmp_path / "drafter")
    args = ["eval", "--drafter", str(tmp_path / "drafter"), "--target", tiny_model_dir, "--prompts", str(prompts),
            "--max-new-tokens", "4"]
    refused = cli(*args, "--out", str(tmp_path / "e1"))
    assert refused.returncode == 1 and f"{prompts}: line 2 is not a record" in refused.stderr
    assert "--skip-unreadable" in refused.stderr and not (tmp_path / "e1").exists()
    skipped = cli(*args, "--out", str(tmp_path / "e2"), "--skip-unreadable", check=True)
    assert skipped.returncode == 0
    rejected = [json.loads(line) for line in (tmp_path / "e2" / "rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [2]

"""An input read once at a stage's edge: the manifest parsed once, checked against, and the files loaded the ones
hashed (flashdraft/artifact/verified.py)."""

import hashlib
import os
from pathlib import Path

import pytest

from flashdraft.artifact.manifest import MANIFEST, NotVerified, build_manifest, write_manifest
from flashdraft.artifact.verified import open_input
from flashdraft.errors import BadInput


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    root.mkdir()
    (root / "data-00000.arrow").write_bytes(os.urandom(50_000))
    (root / "state.json").write_text('{"x": 1}\n')
    write_manifest(root, build_manifest(root, kind="dataset", stats={"tokenizer_vocab": "abc"}))
    return root


def recommit_with(root: Path, name: str, data: bytes) -> None:
    """What another process does to a dataset: a file rewritten and a manifest that lists it, both committed."""
    (root / name).write_bytes(data)
    write_manifest(root, build_manifest(root, kind="dataset", stats={"tokenizer_vocab": "other"}))


def test_the_digest_and_the_stats_are_of_the_manifest_bytes_read_once(dataset):
    opened = open_input(dataset, "dataset", "rebuild it")
    assert opened.digest == hashlib.sha256((dataset / MANIFEST).read_bytes()).hexdigest()
    recommit_with(dataset, "state.json", b'{"x": 2}\n')  # after the lineage was computed from the first manifest
    assert opened.stats == {"tokenizer_vocab": "abc"}  # not read again
    with pytest.raises(NotVerified, match="state.json: content differs"):  # checked against what the lineage names
        opened.verified()
    open_input(dataset, "dataset", "rebuild it").verified()  # the new dataset, opened anew, verifies


def test_a_file_replaced_after_its_hash_is_refused_once_loaded(dataset):
    verified = open_input(dataset, "dataset", "run `flashdraft tokenize` again").verified()
    verified.require_unchanged()  # nothing changed: passes
    replacement = dataset / "replacement"
    replacement.write_bytes((dataset / "data-00000.arrow").read_bytes())  # the same bytes, another file
    replacement.rename(dataset / "data-00000.arrow")
    with pytest.raises(NotVerified, match=r"data-00000.arrow was replaced or rewritten.*tokenize` again"):
        verified.require_unchanged()


def test_a_file_rewritten_in_place_after_its_hash_is_refused_once_loaded(dataset):
    verified = open_input(dataset, "dataset", "rebuild it").verified()
    path = dataset / "state.json"
    with open(path, "r+b") as f:  # same inode, same size, other bytes
        f.write(b'{"x": 9}\n')
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))  # a coarse clock's tick
    with pytest.raises(NotVerified, match="state.json was replaced or rewritten"):
        verified.require_unchanged()


def test_no_manifest_or_a_broken_one_is_one_line_naming_the_dataset(tmp_path, dataset):
    with pytest.raises(BadInput, match=r"is not a verified dataset \(no manifest\): run it"):
        open_input(tmp_path / "nothing", "dataset", "run it")
    (dataset / MANIFEST).write_text("{not json")
    with pytest.raises(BadInput, match=r"dataset .*ds: manifest unparsable"):
        open_input(dataset, "dataset", "run it")


def test_training_refuses_a_dataset_file_replaced_while_it_loads(tiny_target, tiny_dataset, tmp_path, monkeypatch):
    """The setup training runs: a writer that swaps a shard between the re-hash and the load is caught."""
    import shutil

    import flashdraft.train.stage as stage
    from flashdraft.train.distributed import place
    from tests.train.test_train import quiet, tiny_cfg

    data = tmp_path / "ds"
    shutil.copytree(tiny_dataset, data)
    verified = open_input(data, "dataset", "rebuild it").verified()
    shard = next(data.glob("*.arrow"))
    loading = stage.load_dataset_checked

    def swapped_while_loading(*args, **kwargs):
        (data / "swap").write_bytes(shard.read_bytes())
        (data / "swap").rename(shard)
        return loading(*args, **kwargs)

    monkeypatch.setattr(stage, "load_dataset_checked", swapped_while_loading)
    cfg = tiny_cfg(tiny_target, batch_size=4)
    with pytest.raises(NotVerified, match=f"{shard.name} was replaced or rewritten"):
        stage.setup(cfg, verified, tmp_path / "out", tiny_target, place(cfg), None, quiet)


def test_resume_refuses_a_checkpoint_file_replaced_while_it_loads(tiny_target, tiny_dataset, tmp_path, monkeypatch):
    """The checkpoint train resumes from is opened once as the dataset is: verified, loaded, then held to the files
    hashed. A writer that swaps its weights between the check and the load is caught, not trained on."""
    import shutil

    import flashdraft.train.stage as stage
    from tests.train.test_train import quiet, tiny_cfg

    out = tmp_path / "out"
    stage.run(tiny_cfg(tiny_target, max_steps=4), tiny_dataset, out, log=quiet)
    for killed in (out / "drafter", out / "checkpoints" / "step-0000004"):  # as if killed after step 2's checkpoint
        shutil.rmtree(killed)
    weights = out / "checkpoints" / "step-0000002" / "drafter.safetensors"
    loading = stage.load_checkpoint

    def swapped_while_loading(*args, **kwargs):
        (weights.parent / "swap").write_bytes(weights.read_bytes())
        (weights.parent / "swap").rename(weights)
        return loading(*args, **kwargs)

    monkeypatch.setattr(stage, "load_checkpoint", swapped_while_loading)
    with pytest.raises(NotVerified, match="drafter.safetensors was replaced or rewritten.*delete that checkpoint"):
        stage.run(tiny_cfg(tiny_target, max_steps=4), tiny_dataset, out, log=quiet)
    monkeypatch.setattr(stage, "load_checkpoint", loading)
    lines = []
    stage.run(tiny_cfg(tiny_target, max_steps=4), tiny_dataset, out, log=lines.append)  # the same bytes: resumes
    assert any("resuming from step-0000002" in line for line in lines)


def test_a_pull_given_the_manifest_it_checked_pulls_that_one(tmp_path, dataset):
    """train's resume from the store reads a checkpoint's manifest once and hands it to the check and the pull: a
    manifest replaced in the store after it was read is not what lands (before, each step read its own)."""
    from flashdraft.artifact.manifest import verify_dir
    from flashdraft.artifact.store import open_store
    from flashdraft.artifact.sync import pull, push, remote_manifest, verify_store

    store = open_store(str(tmp_path / "store" / "ds"))
    push(dataset, store, log=lambda _: None)
    remote = remote_manifest(store)
    (tmp_path / "store" / "ds" / MANIFEST).write_text("{not json")  # replaced after it was read
    assert verify_store(store, remote=remote) == []
    pull(store, tmp_path / "pulled", remote=remote)
    assert (tmp_path / "pulled" / MANIFEST).read_bytes() == remote[1] and verify_dir(tmp_path / "pulled") == []
    assert verify_store(store)  # read again, the store's own manifest does not parse


def test_tokenize_refuses_a_batch_replaced_while_it_reads_it(tmp_path, smollm2_dir, monkeypatch):
    """tokenize opens a generate artifact once (the lineage's digest, the hash, the batches it lists) and holds the
    batches it read to the files hashed: one swapped in the middle of the run fails it, and no dataset is committed."""
    import json

    import flashdraft.tokenize.records as records
    from flashdraft.config import TokenizeConfig
    from flashdraft.tokenize import run

    gen = tmp_path / "gen"
    gen.mkdir()
    for batch in range(2):
        (gen / f"batch-{batch:06d}.jsonl").write_text("".join(json.dumps({
            "id": f"p{batch}-{i}", "messages": [{"role": "user", "content": f"Question {i}?"}],
            "content": f"Answer {i} is {i + i}, as it was asked.", "reasoning": None, "finish_reason": "stop"}) + "\n"
            for i in range(3)))
    write_manifest(gen, build_manifest(gen, kind="completions"))
    reading = records._jsonl_lines

    def swapped_midway(files):
        for n, item in enumerate(reading(files)):
            if n == 1:  # the same bytes, another file: what a second generate committing here would leave
                (gen / "swap").write_bytes(files[-1].read_bytes())
                (gen / "swap").rename(files[-1])
            yield item

    monkeypatch.setattr(records, "_jsonl_lines", swapped_midway)
    cfg = TokenizeConfig(tokenizer=smollm2_dir, min_loss_fraction=0.0, workers=1)
    with pytest.raises(NotVerified, match="batch-000001.jsonl was replaced or rewritten"):
        run(cfg, gen, tmp_path / "ds", log=lambda _: None)
    assert not (tmp_path / "ds" / MANIFEST).exists()
    monkeypatch.setattr(records, "_jsonl_lines", reading)
    assert run(cfg, gen, tmp_path / "ds", log=lambda _: None)["samples"] == 6  # read whole, the same bytes verify

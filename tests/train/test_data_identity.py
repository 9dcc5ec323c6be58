"""The bytes a run trains on are the bytes hashed, for the whole run: a dataset file's identity includes its inode's
change time, which its owner cannot set back, and train checks every file again before each checkpoint and before
the export. A same-size rewrite in place with its modification time restored (`cp -p`, `rsync -a --inplace`, an
untar over the directory) used to pass as unchanged while the memory-mapped dataset served its new bytes."""

import os
import shutil
from pathlib import Path

import pytest

from flashdraft.artifact.manifest import NotVerified
from flashdraft.artifact.verified import file_identity
from flashdraft.train import run
from tests.train.test_train import quiet, tiny_cfg


def rewrite_in_place_keeping_mtime(path: Path) -> None:
    """The file's own bytes written back over it, in place, its modification time put back as `cp -p` does."""
    stat = os.stat(path)
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_an_in_place_rewrite_with_its_mtime_restored_changes_the_identity(tmp_path):
    path = tmp_path / "shard.arrow"
    path.write_bytes(b"0123456789" * 100)
    before = file_identity(path)
    rewrite_in_place_keeping_mtime(path)
    after = file_identity(path)
    assert before[:4] == after[:4]  # device, inode, size, modification time: all as they were
    assert after != before  # the change time is not


def copied(dataset: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the dataset this test may rewrite, and its first shard."""
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    return data, next(data.glob("*.arrow"))


def test_a_shard_rewritten_during_training_stops_the_run_before_the_next_checkpoint(tiny_target, tiny_dataset,
                                                                                   tmp_path, monkeypatch):
    import flashdraft.train.loop as loop_module

    data, shard = copied(tiny_dataset, tmp_path)
    original = loop_module.save_checkpoint

    def save_then_rewrite(out, step, *args, **kwargs):
        saved = original(out, step, *args, **kwargs)
        if step == 2:  # while the run goes on, someone rsyncs the dataset over itself
            rewrite_in_place_keeping_mtime(shard)
        return saved

    monkeypatch.setattr(loop_module, "save_checkpoint", save_then_rewrite)
    out = tmp_path / "out"
    with pytest.raises(NotVerified, match=rf"{shard.name} was replaced or rewritten while it was trained on; stopped "
                                          r"before the checkpoint at step 4, step-0000002 stays the newest"):
        run(tiny_cfg(tiny_target, max_steps=6, checkpoint_every=2), data, out, log=quiet)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000002"]
    assert not (out / "drafter").exists()


def test_a_shard_rewritten_after_the_last_checkpoint_is_refused_before_the_export(tiny_target, tiny_dataset,
                                                                                 tmp_path, monkeypatch):
    import flashdraft.train.stage as stage_module

    data, shard = copied(tiny_dataset, tmp_path)
    original = stage_module.evaluate_heldout

    def evaluated_then_rewritten(*args, **kwargs):  # the end of a run resumed at its last step: before the export
        held = original(*args, **kwargs)
        rewrite_in_place_keeping_mtime(shard)
        return held

    out = tmp_path / "out"
    cfg = tiny_cfg(tiny_target, max_steps=2, checkpoint_every=2)
    run(cfg, data, out, log=quiet)
    shutil.rmtree(out / "drafter")  # trained to its end; the export is redone from the last checkpoint
    monkeypatch.setattr(stage_module, "evaluate_heldout", evaluated_then_rewritten)
    with pytest.raises(NotVerified, match=r"rewritten while it was trained on; stopped before the export"):
        run(cfg, data, out, log=quiet)
    assert not (out / "drafter").exists()

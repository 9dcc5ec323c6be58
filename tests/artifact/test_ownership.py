"""Ownership of outputs: claim, file-by-file removal, and the per-output lock (real files, real processes)."""

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flashdraft.artifact.manifest import MANIFEST, Lineage, build_manifest, verify_dir, write_manifest
from flashdraft.artifact.ownership import (
    OutputLocked,
    OutputNotOwned,
    claim_output,
    commit_dir,
    lock_path,
    output_lock,
    remove_inside,
)
from flashdraft.errors import BadInput


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under `root` (links as their target text) → content hash: 'nothing changed' made checkable."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def users_dir(path: Path) -> Path:
    (path / "notes").mkdir(parents=True)
    (path / "thesis.tex").write_text("\\chapter{Two years of work}")
    (path / "notes" / "ideas.md").write_text("keep me")
    return path


def test_a_users_directory_or_another_kind_is_refused_and_left_as_it_was(tmp_path):
    mine = users_dir(tmp_path / "thesis")
    before = tree_digest(tmp_path)
    with pytest.raises(OutputNotOwned, match=r"not empty.*thesis.tex.*nothing was changed"):
        claim_output(mine, "dataset")
    with pytest.raises(OutputNotOwned, match="not empty"), commit_dir(mine, "drafter") as tmp:
        (tmp / "config.json").write_text("{}")  # never reached: refused before the build starts
    assert tree_digest(tmp_path) == before
    completions = tmp_path / "gen"
    completions.mkdir()
    (completions / "batch-000000.jsonl").write_text("{}\n")
    write_manifest(completions, build_manifest(completions, kind="completions"))
    before = tree_digest(tmp_path)
    with pytest.raises(OutputNotOwned, match="holds a completions artifact, not a dataset one"):
        claim_output(completions, "dataset")
    assert tree_digest(tmp_path) == before


def test_a_rebuild_removes_only_what_its_manifest_names(tmp_path):
    out = tmp_path / "eval"
    with commit_dir(out, "eval", lineage=Lineage(config="a")) as tmp:
        (tmp / "old-report.json").write_text("{}")
        (tmp / "plots").mkdir()
        (tmp / "plots" / "a.png").write_bytes(b"png")
    with commit_dir(out, "eval", lineage=Lineage(config="b")) as tmp:
        (tmp / "report.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "report.json"] and verify_dir(out) == []

    (out / "my-notes.txt").write_text("a file the user put beside the report")
    with pytest.raises(OutputNotOwned, match="also holds my-notes.txt"), commit_dir(out, "eval") as tmp:
        (tmp / "report.json").write_text("{}")
    assert (out / "my-notes.txt").read_text().startswith("a file") and (out / "report.json").is_file()


def test_commit_dir_leaves_no_temp_and_cleans_a_killed_writers(tmp_path):
    out = tmp_path / "ds"
    (tmp_path / ".flashdraft-tmp-ds.deadhost.123.0badcafe").mkdir()  # what a killed build left
    (tmp_path / ".flashdraft-tmp-ds-other.deadhost.123.0badcafe").mkdir()  # another output's: not touched
    with commit_dir(out, "dataset") as tmp:
        assert tmp.name.startswith(".flashdraft-tmp-ds.") and tmp.parent == tmp_path
        (tmp / "data.arrow").write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".flashdraft-tmp-ds-other.deadhost.123.0badcafe", "ds"]


def test_remove_inside_never_leaves_the_output(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("not flashdraft's")
    (out / "away").symlink_to(tmp_path)  # a directory link inside leading out
    for rel in (str(victim), "../victim.txt", "away/victim.txt", "./../victim.txt", ""):
        assert remove_inside(out, rel) is False
    assert victim.read_text() == "not flashdraft's"
    (out / "mine.bin").write_bytes(b"1")
    assert remove_inside(out, "mine.bin") and not (out / "mine.bin").exists()


def test_a_directory_link_in_an_artifact_is_refused_not_skipped(tmp_path):
    art = tmp_path / "art"
    (art / "sub").mkdir(parents=True)
    (art / "sub" / "a.bin").write_bytes(b"a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.bin").write_bytes(b"b")
    (art / "linked").symlink_to(elsewhere)
    with pytest.raises(BadInput, match="linked links to a directory"):
        build_manifest(art)
    (art / "linked").unlink()
    write_manifest(art, build_manifest(art))
    (art / "linked").symlink_to(elsewhere)
    assert [str(p) for p in verify_dir(art)] == [
        "linked: a link to a directory: an artifact holds files, never links to folders"]


HOLD = """
import sys, time
from flashdraft.artifact.ownership import output_lock
with output_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_writer_is_refused_at_once_naming_the_holder_and_a_dead_ones_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "--some-flag"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(OutputLocked, match=rf"in use by python.* \(pid {holder.pid} on "), output_lock(out):
            pass
        assert time.monotonic() - started < 5  # at once, not after a wait
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel releases the lock, the file stays
        holder.wait()
    assert lock_path(out).exists()
    with output_lock(out), output_lock(out):  # taken over; re-entrant within one process
        assert str(os.getpid()) in lock_path(out).read_text()
    assert not lock_path(out).exists()  # removed on release


def test_a_waiting_lock_blocks_until_the_holder_is_gone(tmp_path):
    """The shared model cache's lock (`wait=True`): a second process waits behind the holder instead of being
    refused, and takes the lock once the holder is gone."""
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    taken = threading.Event()

    def take() -> None:
        with output_lock(out, wait=True):
            taken.set()

    waiter = threading.Thread(target=take)
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter.start()
        assert not taken.wait(1.0)  # behind the holder: a lock that did not wait would be taken at once
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    waiter.join(timeout=60)
    assert taken.is_set()

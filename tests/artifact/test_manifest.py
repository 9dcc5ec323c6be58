import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashdraft.artifact.atomic import atomic_open
from flashdraft.artifact.manifest import (
    MANIFEST,
    Lineage,
    build_manifest,
    check_done,
    list_data_files,
    read_manifest,
    sha256_file,
    verify_dir,
    write_manifest,
)
from flashdraft.artifact.ownership import commit_dir


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    root = tmp_path / "art"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(100_000))
    (root / "b.txt").write_text("hello world\n")
    (root / "sub" / "c.jsonl").write_text('{"x": 1}\n' * 100)
    write_manifest(root, build_manifest(root, kind="files", stats={"n": 3}))
    return root


def test_manifest_lists_every_file_with_size_and_sha256(artifact: Path):
    m = read_manifest(artifact)
    assert [f.path for f in m.files] == ["a.bin", "b.txt", "sub/c.jsonl"]
    for f in m.files:
        assert f.size == (artifact / f.path).stat().st_size
        assert f.sha256 == sha256_file(artifact / f.path)
    raw = json.loads((artifact / MANIFEST).read_text())
    assert raw["format"] == 1 and raw["kind"] == "files" and raw["stats"] == {"n": 3}
    assert set(raw["lineage"]) == {"inputs", "config", "flashdraft"} and raw["created"]


def test_untouched_artifact_verifies(artifact: Path):
    assert verify_dir(artifact) == []


def test_same_size_byte_change_is_caught(artifact: Path):
    data = bytearray((artifact / "a.bin").read_bytes())
    data[50_000] ^= 0xFF
    (artifact / "a.bin").write_bytes(bytes(data))
    os.utime(artifact / "a.bin", (1, 1))  # an old mtime must not hide it
    [p] = verify_dir(artifact)
    assert p.path == "a.bin" and "content differs" in p.problem


def test_truncated_file_is_caught(artifact: Path):
    with open(artifact / "sub" / "c.jsonl", "r+b") as f:
        f.truncate(10)
    [p] = verify_dir(artifact)
    assert p.path == "sub/c.jsonl" and "truncated" in p.problem


def test_missing_file_is_caught(artifact: Path):
    (artifact / "b.txt").unlink()
    [p] = verify_dir(artifact)
    assert p.path == "b.txt" and p.problem == "missing"


def test_unlisted_extra_file_is_caught(artifact: Path):
    (artifact / "sub" / "extra.arrow").write_bytes(b"x")
    [p] = verify_dir(artifact)
    assert p.path == "sub/extra.arrow" and "unlisted" in p.problem


def test_missing_manifest_is_caught(artifact: Path):
    (artifact / MANIFEST).unlink()
    [p] = verify_dir(artifact)
    assert p.path == MANIFEST and "missing" in p.problem


@pytest.mark.parametrize("content", ["{not json", '{"format": 1}', '{"format": 2, "kind": "files"}', ""])
def test_unparsable_manifest_is_caught(artifact: Path, content: str):
    (artifact / MANIFEST).write_text(content)
    [p] = verify_dir(artifact)
    assert p.path == MANIFEST and "unparsable" in p.problem


def test_unsafe_manifest_path_is_refused(artifact: Path):
    raw = json.loads((artifact / MANIFEST).read_text())
    raw["files"].append({"path": "../outside", "size": 1, "sha256": "0" * 64})
    (artifact / MANIFEST).write_text(json.dumps(raw))
    [p] = verify_dir(artifact)
    assert p.path == "../outside" and "refused" in p.problem


def test_leftover_temp_files_are_not_data(artifact: Path):
    (artifact / ".flashdraft-tmp-123-abcd-a.bin").write_bytes(b"half")
    assert verify_dir(artifact) == []
    assert ".flashdraft-tmp-123-abcd-a.bin" not in list_data_files(artifact)


def test_hashing_many_files_matches_serial(tmp_path: Path):
    for i in range(40):
        (tmp_path / f"f{i:02d}").write_bytes(os.urandom(1000 + i))
    parallel = build_manifest(tmp_path, jobs=8)
    serial = build_manifest(tmp_path, jobs=1)
    assert parallel.files == serial.files


# ------------------------------------------------------------------------------------------- atomicity

SLOW_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from flashdraft.artifact.atomic import atomic_open
    from flashdraft.artifact.manifest import build_manifest, write_manifest
    root = Path(sys.argv[1])
    (root / "done.txt").write_text("first file is complete")
    with atomic_open(root / "big.bin") as f:
        for i in range(10_000):
            f.write(b"x" * 65536)
            f.flush()
            if i == 5:
                print("writing", flush=True)
            time.sleep(0.01)
    write_manifest(root, build_manifest(root))
    """
)


def test_sigkill_mid_write_leaves_no_final_file_and_no_manifest(tmp_path: Path):
    root = tmp_path / "art"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    names = sorted(p.name for p in root.iterdir())
    assert "big.bin" not in names and MANIFEST not in names
    assert any(n.startswith(".flashdraft-tmp-") for n in names), names  # the partial bytes stayed in a temp
    [p] = verify_dir(root)
    assert p.path == MANIFEST
    assert not check_done(root, Lineage()).done


def test_a_new_artifact_replaces_a_link_and_leaves_what_it_pointed_at(artifact: Path, tmp_path: Path):
    """An artifact path linked to an artifact kept elsewhere (a shared feature cache): a rebuild there replaces
    the link with its own directory, and the linked artifact stays as it was."""
    linked = tmp_path / "mine"
    linked.symlink_to(artifact)
    with commit_dir(linked, "files", stats={"n": 1}) as tmp:
        (tmp / "new.txt").write_text("rebuilt\n")
    assert not linked.is_symlink() and verify_dir(linked) == [] and read_manifest(linked).stats == {"n": 1}
    assert verify_dir(artifact) == [] and read_manifest(artifact).stats == {"n": 3}


def test_atomic_open_failure_keeps_old_content(tmp_path: Path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(target, "w") as f:
        f.write("new, half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


# ------------------------------------------------------------------------------------------- skip logic


def test_check_done_states(artifact: Path, tmp_path: Path):
    lineage = Lineage(inputs=["abc"], config="cfg1")
    assert check_done(tmp_path / "nothing", lineage).reason == "no manifest yet"

    write_manifest(artifact, build_manifest(artifact, lineage=lineage))
    done = check_done(artifact, lineage)
    assert done.done and "lineage matches" in done.reason
    assert "already done, verified" in done.line("tokenize", artifact)

    other_config = check_done(artifact, Lineage(inputs=["abc"], config="cfg2"))
    assert not other_config.done and "config changed" in other_config.reason
    other_input = check_done(artifact, Lineage(inputs=["xyz"], config="cfg1"))
    assert not other_input.done and "inputs changed" in other_input.reason

    (artifact / "b.txt").write_text("hello World\n")  # same size, different bytes
    tampered = check_done(artifact, lineage)
    assert not tampered.done and "b.txt" in tampered.reason
    assert "building" in tampered.line("tokenize", artifact)


def test_version_alone_does_not_force_rebuild(artifact: Path):
    write_manifest(artifact, build_manifest(artifact, lineage=Lineage(config="c", flashdraft="0.0.1")))
    assert check_done(artifact, Lineage(config="c")).done

"""An input artifact read once, at the edge of a stage, and passed down as one value (DESIGN §1).

    dataset = open_input(data, "dataset", remedy="run `flashdraft tokenize`")  # manifest.json read and parsed once
    lineage = Lineage(inputs=[dataset.digest], ...)                             # the digest of those same bytes
    dataset = dataset.verified()                  # every file re-hashed against that manifest, each one's identity kept
    load(dataset.root); dataset.require_unchanged()                             # what was loaded is what was hashed

Before it, a stage read `manifest.json` again at each step (the lineage, the re-hash, the stats), so a manifest
replaced between two of them could give a lineage of one dataset and a check of another; and the files it loaded
after the re-hash were not tied to the files hashed. Here the manifest is parsed once, its digest is of the same
bytes, and a file replaced or rewritten after its hash (another inode, size, modification or change time) is
refused.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

from flashdraft.artifact.manifest import (
    MANIFEST,
    Manifest,
    ManifestError,
    NotVerified,
    Problem,
    not_verified,
    parse_manifest,
    verify_against,
)
from flashdraft.errors import BadInput

Identity = tuple[int, int, int, int, int]


def file_identity(path: Path) -> Identity:
    """What changes when a file is replaced (device, inode) or rewritten (size, modification time, and the inode's
    change time, which its owner cannot set back: `cp -p`, `rsync -a --inplace` or an untar restores the modification
    time of a file they rewrite in place); not its bytes, which were hashed once: this is the cheap check that they
    are still the bytes hashed."""
    st = os.stat(path, follow_symlinks=False)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class InputArtifact:
    """A committed artifact a stage reads: its directory, its manifest (parsed once) and the sha256 of the manifest's
    bytes (what a lineage records as the input). `identities` is set by `verified()`: each file as it was hashed."""

    root: Path
    what: str  # how errors name it: "dataset", "drafter"
    remedy: str  # what to do when it does not verify
    manifest: Manifest
    digest: str
    identities: dict[str, Identity] | None = None

    @property
    def stats(self) -> dict:
        return self.manifest.stats

    def verified(self) -> InputArtifact:
        """Every listed file present, of its size and sha256, nothing unlisted, against this manifest (not a later
        read of manifest.json); NotVerified names the first that is not. Each file's identity is taken before its
        hash and compared after it, so a file replaced while it was being hashed is refused too."""
        before = self.current_identities()
        problems = verify_against(self.root, self.manifest)
        if not problems and (changed := self.changed_since(before)):
            problems = [Problem(changed, "changed while it was being hashed")]
        if problems:
            raise not_verified(self.what, self.root, problems, self.remedy)
        return replace(self, identities=before)

    def identified(self) -> InputArtifact:
        """The files' identities as they are now, without hashing: for the processes of a node whose first process
        hashed them a moment before (they read the same disk)."""
        return replace(self, identities=self.current_identities())

    def require_unchanged(self, during: str = "while it was loaded") -> None:
        """After loading, and for a memory-mapped input whenever its use is about to be recorded (train: before every
        checkpoint and the export): every file is still the one hashed; one replaced or rewritten since is refused in
        one line (what was read may be neither the checked bytes nor the new ones)."""
        if self.identities is None:
            raise RuntimeError(f"{self.what} {self.root}: require_unchanged before verified()")  # a bug, not input
        if changed := self.changed_since(self.identities):
            raise NotVerified(f"{self.what} {self.root} changed after it was verified ({changed} was replaced or "
                              f"rewritten {during}): {self.remedy}")

    def current_identities(self) -> dict[str, Identity]:
        found = {}
        for entry in self.manifest.files:
            try:
                found[entry.path] = file_identity(self.root / entry.path)
            except OSError:
                found[entry.path] = (0, 0, -1, 0, 0)  # missing: verify_against names it
        return found

    def changed_since(self, identities: dict[str, Identity]) -> str | None:
        now = self.current_identities()
        return next((path for path, was in identities.items() if now.get(path) != was), None)


def open_input(root: str | Path, what: str, remedy: str, error: type[BadInput] = BadInput) -> InputArtifact:
    """The artifact at `root` as a stage's input: its manifest read once and parsed, or one line (`error`, the stage's
    own kind of refusal) saying why not. Nothing is hashed yet (an "already done" rerun never hashes its input):
    `verified()` does that."""
    root = Path(root)
    try:
        raw = (root / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise error(f"{root} is not a verified {what} (no manifest): {remedy}") from None
    except OSError as e:
        raise error(f"{what} {root}: its manifest cannot be read ({e.strerror})") from None
    try:
        manifest = parse_manifest(raw)
    except ManifestError as e:
        raise error(f"{what} {root}: manifest {e}: {remedy}") from None
    return InputArtifact(root, what, remedy, manifest, hashlib.sha256(raw).hexdigest())

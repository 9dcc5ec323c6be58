"""Checkpoints: save, load, find the newest complete one, prune, and ship them to a store in the background.

    <out>/checkpoints/step-0000200/   drafter.safetensors, optimizer.pt, position.json, manifest.json

Each checkpoint is an artifact (manifest last, committed by one rename): a crash mid-save leaves no
checkpoint that `latest_checkpoint` would pick. Resume restores model, optimizer, scheduler and the data
position; anchors are a function of (seed, epoch, sample), so a resumed run follows the same loss curve.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import MANIFEST, Lineage, ManifestError, commit_dir, read_manifest, verify_dir
from flashdraft.config import TrainConfig
from flashdraft.layout import CHECKPOINTS, DRAFTER, join


def checkpoint_dirs(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    return sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []


def full_state(model, optimizer) -> tuple[dict, dict]:
    """The whole drafter's weights and optimizer state, on CPU, keyed by parameter name. Under FSDP they are
    gathered from every rank's shards: a collective, so every rank calls it, and rank 0 gets the result (the
    others get empty dicts). The same call serves DDP and a single process, so a checkpoint reads the same
    whichever way it was written."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(out: Path, step: int, state: tuple[dict, dict], scheduler, position: dict,
                    lineage: Lineage) -> Path:
    """A checkpoint is an artifact: weights, optimizer + scheduler, data position; committed in one rename.
    `state`: what `full_state` returned (on rank 0, which alone writes)."""
    final = out / CHECKPOINTS / f"step-{step:07d}"
    weights, optimizer_state = state
    with commit_dir(final, "checkpoint", stats=position, lineage=lineage) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / "drafter.safetensors"))
        torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        atomic_write_text(tmp / "position.json", json.dumps(position))
    return final


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore what `save_checkpoint` wrote, on every rank (each reads the whole checkpoint; FSDP keeps its own
    shard of it); returns the data position (step, epoch, batch) to continue from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = torch.load(path / "optimizer.pt", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=load_file(str(path / "drafter.safetensors")),
                   optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    return json.loads((path / "position.json").read_text())


def prune_checkpoints(out: Path, keep: int, upto: str | None = None) -> list[str]:
    """Delete all but the newest `keep` checkpoints (complete or not): disk stays bounded on long runs.
    With `upto`, only checkpoints no newer than that one are candidates (newer ones may not be pushed yet)."""
    removed = []
    for path in checkpoint_dirs(out)[max(1, keep) :]:
        if upto is None or path.name <= upto:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def prune_store_checkpoints(push_to: str, keep: int, upto: str) -> list[str]:
    """`keep_checkpoints` in the store: delete all but the newest `keep` there, called only once checkpoint
    `upto` verified in the store (so never the newest good one). A checkpoint's manifest is deleted first: what
    is left of one whose deletion was interrupted never verifies, and is neither resumed from nor kept."""
    from flashdraft.artifact.store import open_store

    store = open_store(join(push_to, CHECKPOINTS))
    listed = store.list()
    names = sorted({key.split("/", 1)[0] for key in listed}, reverse=True)
    removed = []
    for name in names[max(1, keep) :]:
        if name > upto:
            continue
        keys = [key for key in listed if key.startswith(f"{name}/")]
        for key in sorted(keys, key=lambda k: k != f"{name}/{MANIFEST}"):  # the manifest first
            store.delete(key)
        removed.append(name)
    return removed


class CheckpointShipper:
    """Pushes each checkpoint to `train.push_to` (verified there) and prunes old ones, locally and in the store,
    in one background thread so training does not wait on the network. FIFO: after checkpoint N is pushed,
    every checkpoint up to N has been, so only those are pruned; newer ones may still wait for their push."""

    def __init__(self, out: Path, cfg: TrainConfig, log: Callable[[str], None]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.out, self.cfg, self.log = out, cfg, log
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-push")
        self.pending: list = []

    def _push(self, local: Path, name: str) -> None:
        from flashdraft.artifact.store import open_store
        from flashdraft.artifact.sync import push

        self.log(push(local, open_store(join(self.cfg.push_to, name)), log=self.log).line())

    def checkpoint(self, path: Path) -> None:
        def ship() -> None:
            if self.cfg.push_to:
                self._push(path, f"{CHECKPOINTS}/{path.name}")  # returns once it verified in the store
                prune_store_checkpoints(self.cfg.push_to, self.cfg.keep_checkpoints, upto=path.name)
            prune_checkpoints(self.out, self.cfg.keep_checkpoints, upto=path.name)

        self.pending.append(self.pool.submit(ship))

    def drafter(self, path: Path) -> None:
        if self.cfg.push_to:
            self.pending.append(self.pool.submit(self._push, path, DRAFTER))

    def wait(self) -> None:
        """Block until every push is done; the first failure (e.g. VerifyFailed) is raised here."""
        try:
            for future in self.pending:
                future.result()
        finally:
            self.pool.shutdown(wait=True)


def latest_checkpoint(out: Path, lineage: Lineage, log: Callable[[str], None]) -> Path | None:
    for path in checkpoint_dirs(out):
        problems = verify_dir(path)
        if problems:
            log(f"train: ignoring incomplete checkpoint {path.name} ({problems[0]})")
            continue
        if not read_manifest(path).lineage.same_work(lineage):
            log(f"train: ignoring checkpoint {path.name} (made from other data or settings)")
            continue
        return path
    return None


def pull_newer_checkpoint(out: Path, push_to: str, lineage: Lineage, local: Path | None,
                          log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of this run that verifies in the store, pulled into `out` when it is newer than the
    newest local one: a replacement machine with an empty disk continues where the last push left off."""
    from flashdraft.artifact.store import open_store
    from flashdraft.artifact.sync import pull, remote_manifest, verify_store

    listed = open_store(join(push_to, CHECKPOINTS)).list()
    names = sorted({key.split("/", 1)[0] for key in listed if key.endswith(f"/{MANIFEST}")}, reverse=True)
    for name in names:
        if local is not None and name <= local.name:
            return None  # the local disk has this one or a newer one
        store = open_store(join(push_to, f"{CHECKPOINTS}/{name}"))
        if not remote_manifest(store)[0].lineage.same_work(lineage):
            log(f"train: ignoring {store.url} (made from other data or settings)")
            continue
        if problems := verify_store(store):
            log(f"train: ignoring {store.url} ({problems[0]})")
            continue
        log(pull(store, out / CHECKPOINTS / name, delete=True).line())
        return out / CHECKPOINTS / name
    return None


def other_work(out: Path, lineage: Lineage) -> str | None:
    """A finished drafter or complete checkpoint in `out` made from other data or settings (None if none)."""
    for path in [out / DRAFTER, *checkpoint_dirs(out)]:
        try:
            made = read_manifest(path).lineage
        except ManifestError:
            continue  # absent or incomplete: nothing finished to lose
        if not made.same_work(lineage):
            return f"{path.relative_to(out)}"
    return None

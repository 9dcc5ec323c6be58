"""Checkpoints: save, load, find the newest complete one, prune, and ship them to a store in the background.

    <out>/checkpoints/step-0000200/   drafter.safetensors, optimizer.safetensors, trainer_state.json,
                                      position.json, manifest.json

Each checkpoint is an artifact (manifest last, committed by one rename): a crash mid-save leaves no
checkpoint that `latest_checkpoint` would pick. Resume restores model, optimizer, scheduler and the data
position; anchors are a function of (seed, epoch, sample), so a resumed run follows the same loss curve.

Nothing in a checkpoint is executed when it is loaded: a checkpoint may come from a store other machines write
to. Tensors (weights, optimizer moments) are safetensors; everything else (param groups, scheduler, position)
is JSON. Never pickle: a planted `optimizer.pt` would run its payload on the training node.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from flashdraft.artifact.atomic import atomic_write_text, write_safetensors
from flashdraft.artifact.manifest import MANIFEST, Lineage, ManifestError, NotVerified, read_manifest
from flashdraft.artifact.ownership import commit_dir, remove_artifact
from flashdraft.artifact.verified import InputArtifact, open_input
from flashdraft.config import TrainConfig
from flashdraft.errors import BadInput, BadTrainingInput, ExpectedFailure
from flashdraft.layout import CHECKPOINTS, DRAFTER, join


def checkpoint_dirs(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    return sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []


def full_state(model, optimizers) -> tuple[dict, dict]:
    """The whole drafter's weights and optimizer state, on CPU, keyed by parameter name. Under FSDP they are
    gathered from every rank's shards: a collective, so every rank calls it, and rank 0 gets the result (the
    others get empty dicts). The same call serves DDP and a single process, so a checkpoint reads the same
    whichever way it was written."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizers.all, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


OPTIMIZER_TENSORS = "optimizer.safetensors"  # per-parameter optimizer state, keyed "<param name>/<state key>"
TRAINER_STATE = "trainer_state.json"  # param groups, non-tensor optimizer state, the scheduler's state
LEGACY_OPTIMIZER = "optimizer.pt"  # flashdraft ≤ 0.1 (pickled); read only with torch.load(weights_only=True)


def split_optimizer_state(optimizer_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A full optimizer state dict as (tensors for safetensors, the rest as JSON-able values)."""
    tensors, plain = {}, {}
    for name, per_param in optimizer_state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                plain.setdefault(str(name), {})[key] = value
    return tensors, {"state": plain, "param_groups": optimizer_state["param_groups"]}


def join_optimizer_state(tensors: dict[str, torch.Tensor], plain: dict) -> dict:
    """The inverse of `split_optimizer_state`."""
    state: dict[str, dict] = {name: dict(values) for name, values in plain["state"].items()}
    for flat, value in tensors.items():
        name, key = flat.rsplit("/", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": plain["param_groups"]}


def save_checkpoint(out: Path, step: int, state: tuple[dict, dict], optimizers, position: dict,
                    lineage: Lineage, feature_proof: dict | None = None) -> Path:
    """A checkpoint is an artifact: weights, optimizer + scheduler, data position; committed in one rename.
    `state`: what `full_state` returned (on rank 0, which alone writes). `feature_proof`: a fleet's proof that the
    states trained on since the last checkpoint were the target's (train/fleet.py), in its manifest's stats."""
    final = out / CHECKPOINTS / f"step-{step:07d}"
    weights, optimizer_state = state
    optimizer_tensors, optimizer_plain = split_optimizer_state(optimizer_state)
    trainer_state = {"optimizer": optimizer_plain, "scheduler": optimizers.schedule_state()}
    if final.is_dir() and not (final / MANIFEST).is_file():  # what a killed pull left in train's own layout
        shutil.rmtree(final)
    stats = {**position, **({"feature_proof": feature_proof} if feature_proof else {})}
    with commit_dir(final, "checkpoint", stats=stats, lineage=lineage) as tmp:
        write_safetensors({k: v.detach().cpu().contiguous() for k, v in weights.items()}, tmp / "drafter.safetensors")
        write_safetensors(optimizer_tensors, tmp / OPTIMIZER_TENSORS)
        atomic_write_text(tmp / TRAINER_STATE, json.dumps(trainer_state, allow_nan=True))
        atomic_write_text(tmp / "position.json", json.dumps(position))
    return final


def load_checkpoint(path: Path, model, optimizers) -> dict:
    """Restore what `save_checkpoint` wrote, on every rank (each reads the whole checkpoint; FSDP keeps its own
    shard of it); returns the data position (step, epoch, batch) to continue from. Reads only safetensors and
    JSON (a legacy `optimizer.pt` under `weights_only=True`, which refuses anything but tensors and plain data)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if (path / OPTIMIZER_TENSORS).is_file():
        trainer_state = json.loads((path / TRAINER_STATE).read_text())
        optimizer_state = join_optimizer_state(load_file(str(path / OPTIMIZER_TENSORS)), trainer_state["optimizer"])
        scheduler_state = trainer_state["scheduler"]
    else:
        try:
            legacy = torch.load(path / LEGACY_OPTIMIZER, weights_only=True)
        except Exception as e:  # weights_only refuses code (UnpicklingError), or the file is damaged
            raise BadTrainingInput(f"{path}/{LEGACY_OPTIMIZER} is not a plain optimizer state ({type(e).__name__}); "
                                   "it was not loaded: delete that checkpoint to start over") from None
        optimizer_state, scheduler_state = legacy["optimizer"], legacy["scheduler"]
    position = read_position(path)  # before any state changes, as the schedule below
    optimizers.load_schedule_state(scheduler_state)  # first: a mismatch is refused before any state changes
    try:
        set_state_dict(model, optimizers.all, model_state_dict=load_file(str(path / "drafter.safetensors")),
                       optim_state_dict=optimizer_state, options=StateDictOptions(full_state_dict=True))
    except (RuntimeError, ValueError, KeyError, SafetensorError) as e:  # another shape, a missing tensor
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise BadTrainingInput(f"{path} does not fit this drafter ({first}); it was not loaded: delete that "
                               "checkpoint to start over") from None
    return position


class Position(BaseModel):
    """Where a checkpoint's run stood: read from position.json, which a hand or another program may have edited."""

    model_config = ConfigDict(extra="forbid", strict=True)
    step: Annotated[int, Field(ge=1, le=2**31 - 1)]
    epoch: Annotated[int, Field(ge=0, le=2**31 - 1)]
    batch: Annotated[int, Field(ge=0, le=2**31 - 1)]


def read_position(path: Path) -> dict:
    """A checkpoint's position, checked: whole numbers in range, and the step its directory is named for."""
    try:
        position = Position.model_validate_json((path / "position.json").read_bytes())
    except (OSError, ValidationError) as e:
        why = e.strerror if isinstance(e, OSError) else e.errors()[0]["msg"]
        raise BadTrainingInput(f"{path}/position.json is not a checkpoint position ({why}): delete that checkpoint "
                               "to start over") from None
    named = path.name.removeprefix("step-")
    if not named.isdigit() or int(named) != position.step:
        raise BadTrainingInput(f"{path}/position.json says step {position.step}, but the checkpoint is {path.name}: "
                               "delete that checkpoint to start over")
    return position.model_dump()


def prune_checkpoints(out: Path, keep: int, removable: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Delete all but the newest `keep` checkpoints (complete or not) that `removable` allows: disk stays bounded
    on long runs. Each is removed as its manifest names its files; one without a manifest (a pull that was
    killed) is a directory of train's own layout under its own --out, removed whole."""
    removed = []
    for path in checkpoint_dirs(out)[max(1, keep) :]:
        if removable(path.name):
            if (path / MANIFEST).is_file():
                remove_artifact(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def prune_store_checkpoints(push_to: str, keep: int, upto: str, lineage: Lineage) -> list[str]:
    """`keep_checkpoints` in the store: delete all but the newest `keep` there, called only once checkpoint
    `upto` verified in the store (so never the newest good one), and never one another run made (its manifest's
    lineage differs). A checkpoint's manifest is deleted first: what is left of one whose deletion was
    interrupted never verifies, and is neither resumed from nor kept."""
    from flashdraft.artifact.manifest import parse_manifest
    from flashdraft.artifact.store import open_store

    store = open_store(join(push_to, CHECKPOINTS))
    listed = store.list()
    names = sorted({key.split("/", 1)[0] for key in listed}, reverse=True)
    removed = []
    for name in names[max(1, keep) :]:
        if name > upto:
            continue
        if f"{name}/{MANIFEST}" in listed:
            try:
                theirs = parse_manifest(store.read_bytes(f"{name}/{MANIFEST}") or b"")
            except ManifestError:
                continue
            if not theirs.lineage.same_work(lineage):
                continue
        keys = [key for key in listed if key.startswith(f"{name}/")]
        for key in sorted(keys, key=lambda k: k != f"{name}/{MANIFEST}"):  # the manifest first
            store.delete(key)
        removed.append(name)
    return removed


class PushFailed(ExpectedFailure):
    """A checkpoint could not be pushed to train.push_to after every attempt: training stops, checkpoints kept."""


def push_backoff_s() -> float:
    """The first retry's wait (FLASHDRAFT_PUSH_BACKOFF_S, 5 s); it doubles, up to 60 s. Read when a push fails."""
    return float(os.environ.get("FLASHDRAFT_PUSH_BACKOFF_S", "5"))


class CheckpointShipper:
    """Pushes each checkpoint to `train.push_to` (verified there) and prunes old ones in the store, in one
    background thread so training does not wait on the network. FIFO: after checkpoint N is pushed, every
    checkpoint up to N has been, so only those are pruned in the store.

    A failed push is logged when it happens and retried with backoff, up to `train.push_attempts` tries; a
    checkpoint that still could not be pushed stops training at the next step (`raise_if_failed`) with that
    reason. Local pruning runs on the training thread, apart from the push queue: it keeps the newest
    `keep_checkpoints`, every checkpoint not yet pushed, and the newest pushed one."""

    def __init__(self, out: Path, cfg: TrainConfig, log: Callable[[str], None], lineage: Lineage | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.out, self.cfg, self.log, self.lineage = out, cfg, log, lineage or Lineage()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-push")
        self.pending: list = []
        self.pushed: set[str] = set()  # checkpoints verified in the store (names)
        self.failure: str | None = None

    def _push(self, local: Path, name: str) -> None:
        """Push and verify, retried with backoff; each failed attempt is logged as it happens."""
        from flashdraft.artifact.store import open_store
        from flashdraft.artifact.sync import push

        attempts = self.cfg.push_attempts
        for attempt in range(1, attempts + 1):
            try:
                self.log(push(local, open_store(join(self.cfg.push_to, name)), log=self.log).line())
                return
            except (ExpectedFailure, OSError) as e:  # OSError: a local store's disk refused
                if attempt == attempts:
                    raise
                wait = min(60.0, push_backoff_s() * 2 ** (attempt - 1))
                self.log(f"train: push of {name} failed (attempt {attempt} of {attempts}): {e}; retrying in "
                         f"{wait:.0f} s")
                time.sleep(wait)

    def checkpoint(self, path: Path) -> None:
        def ship() -> None:
            try:
                self._push(path, f"{CHECKPOINTS}/{path.name}")  # returns once it verified in the store
                self.pushed.add(path.name)
                prune_store_checkpoints(self.cfg.push_to, self.cfg.keep_checkpoints, path.name, self.lineage)
            except (ExpectedFailure, OSError) as e:
                failed = (f"checkpoint {path.name} could not be pushed to {self.cfg.push_to} after "
                          f"{self.cfg.push_attempts} attempt(s): {e}")
                self.log(f"train: {failed}")
                self.failure = self.failure or failed  # the first one is what stops the run

        if self.cfg.push_to:
            self.pending.append(self.pool.submit(ship))
        self.prune_local()

    def prune_local(self) -> None:
        if not self.cfg.push_to:
            prune_checkpoints(self.out, self.cfg.keep_checkpoints)
            return
        pushed = set(self.pushed)  # a copy: the push thread adds to it
        newest_pushed = max(pushed, default=None)
        prune_checkpoints(self.out, self.cfg.keep_checkpoints, lambda name: name in pushed and name != newest_pushed)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise PushFailed(f"{self.failure}. Training stopped; the local checkpoints are kept: fix the store "
                             "(credentials, endpoint, space) and rerun the same command to resume")

    def drafter(self, path: Path) -> None:
        if self.cfg.push_to:
            self.pending.append(self.pool.submit(self._push, path, DRAFTER))

    def wait(self) -> None:
        """Block until every push is done; a checkpoint or drafter push that failed is raised here."""
        try:
            for future in self.pending:
                future.result()
        finally:
            self.pool.shutdown(wait=True)
        self.raise_if_failed()
        self.prune_local()


RESUME_REMEDY = "delete that checkpoint to start over"


def latest_checkpoint(out: Path, lineage: Lineage, log: Callable[[str], None]) -> InputArtifact | None:
    """The newest local checkpoint of this run that verifies, opened once (InputArtifact): its manifest parsed once,
    its files hashed against it, so what resume loads can be held to the bytes checked (`require_unchanged`)."""
    for path in checkpoint_dirs(out):
        try:
            checkpoint = open_input(path, "checkpoint", RESUME_REMEDY).verified()
        except (BadInput, NotVerified) as e:  # killed before its commit (no manifest), or a file that differs
            reason = e.problems[0] if isinstance(e, NotVerified) else f"{MANIFEST}: missing or unreadable"
            log(f"train: ignoring incomplete checkpoint {path.name} ({reason})")
            continue
        if not checkpoint.manifest.lineage.same_work(lineage):
            log(f"train: ignoring checkpoint {path.name} (made from other data or settings)")
            continue
        return checkpoint
    return None


def pull_newer_checkpoint(out: Path, push_to: str, lineage: Lineage, local: InputArtifact | None,
                          log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of this run that verifies in the store, pulled into `out` when it is newer than the
    newest local one: a replacement machine with an empty disk continues where the last push left off. Each
    candidate's manifest is read from the store once: its lineage, the store's check and the pull all use it."""
    from flashdraft.artifact.store import StoreError, open_store
    from flashdraft.artifact.sync import pull, remote_manifest, verify_store

    listed = open_store(join(push_to, CHECKPOINTS)).list()
    names = sorted({key.split("/", 1)[0] for key in listed if key.endswith(f"/{MANIFEST}")}, reverse=True)
    for name in names:
        if local is not None and name <= local.root.name:
            return None  # the local disk has this one or a newer one
        store = open_store(join(push_to, f"{CHECKPOINTS}/{name}"))
        try:
            remote = remote_manifest(store)
        except StoreError as e:  # deleted since it was listed (pruned), or not a manifest
            log(f"train: ignoring {store.url} ({e})")
            continue
        if not remote[0].lineage.same_work(lineage):
            log(f"train: ignoring {store.url} (made from other data or settings)")
            continue
        if problems := verify_store(store, remote=remote):
            log(f"train: ignoring {store.url} ({problems[0]})")
            continue
        log(pull(store, out / CHECKPOINTS / name, delete=True, remote=remote).line())
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


def store_other_work(push_to: str, lineage: Lineage) -> str | None:
    """A drafter or checkpoint in the store under `push_to` that another run made (None if none): pushing there
    would replace it, and that run's replacement node would then start over."""
    from flashdraft.artifact.manifest import parse_manifest
    from flashdraft.artifact.store import open_store

    store = open_store(push_to)
    manifests = [key for key in store.list() if key == f"{DRAFTER}/{MANIFEST}" or (
        key.startswith(f"{CHECKPOINTS}/") and key.endswith(f"/{MANIFEST}") and key.count("/") == 2)]
    for key in manifests:
        try:
            made = parse_manifest(store.read_bytes(key) or b"").lineage
        except ManifestError:
            continue  # unreadable: not a finished artifact of anyone's
        if not made.same_work(lineage):
            return join(push_to, key.removesuffix(f"/{MANIFEST}"))
    return None

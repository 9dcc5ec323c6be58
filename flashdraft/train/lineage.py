"""What a training run is, for its lineage: the dataset, the settings that change what is trained, the target and
the drafter it starts from by identity — and, on several processes, the same on every one of them, checked.

    lineage = run_lineage(cfg, dataset.digest, target_path, world)
"""

from __future__ import annotations

from flashdraft.artifact.manifest import Lineage, identity, sha256_json
from flashdraft.artifact.verified import InputArtifact, open_input
from flashdraft.config import TrainConfig
from flashdraft.errors import BadTrainingInput
from flashdraft.train.distributed import agree

# Settings that say where or how output is kept, not what is trained: changing them keeps the lineage.
# how a run is placed, not what it trains (the number of processes is in the lineage as its world size)
NOT_LINEAGE = {"device", "target_device", "push_to", "push_attempts", "keep_checkpoints", "micro_batch", "prefetch",
               "nproc_per_node", "engine_python", "nnodes", "node_rank", "rdzv_endpoint", "engine_urls",
               "engine_storage"}


def not_lineage(cfg: TrainConfig) -> set[str]:
    """The settings left out of a run's lineage: NOT_LINEAGE, and the feature source while it is transformers (a
    run from before the engine source keeps its lineage; one on the engine's features is another run)."""
    return NOT_LINEAGE | ({"feature_source"} if cfg.feature_source == "transformers" else set())


def open_dataset(data) -> InputArtifact:
    """train's dataset, opened once where a run starts (in each process, or in the launcher before it starts any):
    its manifest read and parsed; its digest is the lineage's input."""
    return open_input(data, "dataset", "run `flashdraft tokenize` (again), or pull it again", BadTrainingInput)


def run_lineage(cfg: TrainConfig, dataset_digest: str, target_path: str, world: int) -> Lineage:
    """The run's lineage; with several processes, first checked to be every process's (`agree`): each node computed
    its own from its own --data, config and target, so what they share is compared, not assumed."""
    settings, target_identity = cfg.model_dump(exclude=not_lineage(cfg)), identity(target_path)
    lineage = _lineage(cfg, dataset_digest, settings, target_identity, world)
    shared = {k: v for k, v in settings.items() if k not in ("target", "init_from")}  # by identity, not path
    agree(world, {"dataset": lineage.inputs[0], "config": sha256_json(shared), "target": target_identity,
                  "flashdraft version": lineage.flashdraft})
    return lineage


def lineage_of(cfg: TrainConfig, dataset_digest: str, target_path: str, world: int) -> Lineage:
    """The same lineage without the collective: the launcher reads it before it starts any process."""
    return _lineage(cfg, dataset_digest, cfg.model_dump(exclude=not_lineage(cfg)), identity(target_path), world)


def _lineage(cfg: TrainConfig, dataset_digest: str, settings: dict, target_identity: str, world: int) -> Lineage:
    return Lineage(
        inputs=[dataset_digest],  # the sha256 of the dataset's manifest, read once at train's edge
        config=sha256_json(
            {"train": settings, "world": world, "target": target_identity,
             "init_from": identity(cfg.init_from) if cfg.init_from else None}
        ),
    )

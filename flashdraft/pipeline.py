"""The pipeline: generate → tokenize → train → eval, each stage skipped when its output verifies.

    flashdraft run examples/demo.yaml [--from tokenize] [--until train] [--store s3://bucket/run1]
    flashdraft demo

A plain list of steps (datatrove-style): each reads the previous stage's artifact and writes its own, at the
places `flashdraft.layout` defines; each decides for itself whether it is already done (manifest verifies,
lineage matches). With `store`, every artifact is pushed there as it completes and verified at the
destination (train also pushes each checkpoint), and an artifact (or the input of the first stage run) that
verifies only in the store is pulled instead of rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashdraft.config import PipelineConfig
from flashdraft.errors import BadInput
from flashdraft.layout import STAGES, stage_dir, stage_url, train_dir, train_url


def selected(from_stage: str | None, until: str | None) -> list[str]:
    for name in (from_stage, until):
        if name is not None and name not in STAGES:
            raise BadInput(f"unknown stage {name!r}: one of {', '.join(STAGES)}")
    first = STAGES.index(from_stage) if from_stage else 0
    last = STAGES.index(until) if until else len(STAGES) - 1
    if first > last:
        raise BadInput(f"--from {from_stage} comes after --until {until}: nothing would run")
    return list(STAGES[first : last + 1])


def run_pipeline(
    cfg: PipelineConfig,
    *,
    from_stage: str | None = None,
    until: str | None = None,
    console=None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    from flashdraft import evaluate, generate, tokenize, train

    work = cfg.workdir
    train_cfg = cfg.train
    if cfg.store and not train_cfg.push_to:  # checkpoints go to the store too, beside the drafter
        train_cfg = train_cfg.model_copy(update={"push_to": train_url(cfg.store)})
    steps = {
        "generate": lambda: generate.run(cfg.generate, stage_dir(work, "generate"), console=console, log=log),
        "tokenize": lambda: tokenize.run(cfg.tokenize, stage_dir(work, "generate"), stage_dir(work, "tokenize"),
                                         console=console, log=log),
        "train": lambda: train.run(train_cfg, stage_dir(work, "tokenize"), train_dir(work), console=console, log=log),
        "eval": lambda: evaluate.run(cfg.eval, stage_dir(work, "train"), stage_dir(work, "eval"), log=log),
    }
    results = {}
    chosen = selected(from_stage, until)
    for stage in chosen:
        if cfg.store:
            before = STAGES[STAGES.index(stage) - 1] if stage != STAGES[0] else None
            for needed in ([before] if before and before not in chosen else []) + [stage]:
                fetch_verified(stage_dir(work, needed), stage_url(cfg.store, needed), log)
        results[stage] = steps[stage]()
        if cfg.store:
            from flashdraft.artifact.store import open_store
            from flashdraft.artifact.sync import push

            log(push(stage_dir(work, stage), open_store(stage_url(cfg.store, stage)), log=log).line())
    return results


def fetch_verified(local, remote: str, log: Callable[[str], None]) -> bool:
    """Pull `remote` into `local` when only the store holds a verified copy (a fresh machine joining a run).
    The stage then decides as always: matching lineage ⇒ already done; otherwise it rebuilds."""
    from flashdraft.artifact.manifest import verify_dir
    from flashdraft.artifact.store import open_store
    from flashdraft.artifact.sync import pull, verify_store

    if not verify_dir(local):
        return False
    store = open_store(remote)
    if verify_store(store):
        return False
    log(pull(store, local, delete=True).line())
    return True

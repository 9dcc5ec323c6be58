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
from pathlib import Path
from typing import Any

from flashdraft.config import PipelineConfig
from flashdraft.errors import BadInput
from flashdraft.layout import STAGES, generate_dir, generate_parts, join, stage_dir, stage_url, train_dir, train_url


class ShardsMissing(BadInput):
    """Tokenize needs every generate shard; some are not verified here or in the store yet."""


def require_shards(workdir, num_shards: int) -> None:
    """With generate.num_shards N > 1: every shard artifact must be here (committed: its manifest reads) before
    tokenize starts. Each is hashed once, where tokenize opens it to read (tokenize/records.py), not here too."""
    from flashdraft.artifact.verified import open_input

    if num_shards <= 1:
        return
    missing = []
    for part in generate_parts(num_shards):
        try:
            open_input(Path(workdir) / part, "generate shard", "")
        except BadInput:
            missing.append(part)
    if missing:
        raise ShardsMissing(
            f"tokenize needs all {num_shards} generate shards; {len(missing)} not here: {', '.join(missing)}. "
            "Run `flashdraft run --until generate` with generate.shard_index set on the hosts that own them "
            "(with --store, their pushes are pulled here), then rerun")


def train_settings(cfg: PipelineConfig):
    """train's settings as `run`, `train --config` and preflight use them: with a store and no push_to of its own,
    checkpoints and the drafter go to STORE/train."""
    if cfg.store and not cfg.train.push_to:
        return cfg.train.model_copy(update={"push_to": train_url(cfg.store)})
    return cfg.train


def eval_settings(cfg: PipelineConfig):
    """eval's settings as `run` uses them: unless the config sets eval.thinking, the mode generation used
    (generate.thinking: on, off, or both for "mixed"), since that is the drafter's own mode."""
    if "thinking" in cfg.eval.model_fields_set:
        return cfg.eval
    mode = cfg.generate.thinking
    return cfg.eval.model_copy(update={"thinking": [True, False] if mode == "mixed" else mode})


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
    train_cfg = train_settings(cfg)
    shards = cfg.generate.num_shards
    mine = generate_dir(work, cfg.generate.shard_index, shards)  # this host's generate artifact

    def tokenize_all():
        require_shards(work, shards)
        return tokenize.run(cfg.tokenize, stage_dir(work, "generate"), stage_dir(work, "tokenize"), console=console,
                            log=log)

    steps = {
        "generate": lambda: generate.run(cfg.generate, mine, console=console, log=log),
        "tokenize": tokenize_all,
        "train": lambda: train.run(train_cfg, stage_dir(work, "tokenize"), train_dir(work), console=console, log=log),
        "eval": lambda: evaluate.run(eval_settings(cfg), stage_dir(work, "train"), stage_dir(work, "eval"),
                                     console=console, log=log),
    }
    results = {}
    chosen = selected(from_stage, until)

    def places(stage: str, every_shard: bool) -> list[tuple]:
        """(local, store) pairs of a stage's artifacts: generate's is this host's shard, or all of them (what
        tokenize reads)."""
        if stage == "generate":
            parts = generate_parts(shards) if every_shard else [mine.relative_to(work).as_posix()]
            return [(Path(work) / part, join(cfg.store, part)) for part in parts]
        return [(stage_dir(work, stage), stage_url(cfg.store, stage))]

    for stage in chosen:
        if cfg.store:
            before = STAGES[STAGES.index(stage) - 1] if stage != STAGES[0] else None
            inputs = [before] if before and (before not in chosen or before == "generate") else []
            for needed in inputs + [stage]:
                for local, remote in places(needed, every_shard=needed != stage):
                    fetch_verified(local, remote, log)
        results[stage] = steps[stage]()
        if cfg.store:
            from flashdraft.artifact.store import open_store
            from flashdraft.artifact.sync import push

            (local, remote), = places(stage, every_shard=False)  # generate: this host's shard only
            log(push(local, open_store(remote), log=log).line())
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
    log(pull(store, local).line())  # replaces only its own kind's files
    return True

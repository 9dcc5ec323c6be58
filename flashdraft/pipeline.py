"""The pipeline: generate → tokenize → train → eval, each stage skipped when its output verifies.

    flashdraft run examples/demo.yaml [--from tokenize] [--until train] [--store s3://bucket/run1]
    flashdraft demo

A plain list of steps (datatrove-style): each reads the previous stage's artifact directory under `workdir`
and writes its own; each decides for itself whether it is already done (manifest verifies, lineage matches).
With `store`, every artifact is pushed there as it completes and verified at the destination, and an
artifact (or the input of the first stage run) that verifies only in the store is pulled instead of rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashdraft.config import PipelineConfig

STAGES = ("generate", "tokenize", "train", "eval")


def artifact_dirs(cfg: PipelineConfig) -> dict[str, Path]:
    work = Path(cfg.workdir)
    return {
        "generate": work / "generate",
        "tokenize": work / "dataset",
        "train": work / "train" / "drafter",
        "eval": work / "eval",
    }


def selected(from_stage: str | None, until: str | None) -> list[str]:
    for name in (from_stage, until):
        if name is not None and name not in STAGES:
            raise ValueError(f"unknown stage {name!r}: one of {', '.join(STAGES)}")
    first = STAGES.index(from_stage) if from_stage else 0
    last = STAGES.index(until) if until else len(STAGES) - 1
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

    dirs = artifact_dirs(cfg)
    steps = {
        "generate": lambda: generate.run(cfg.generate, dirs["generate"], console=console, log=log),
        "tokenize": lambda: tokenize.run(cfg.tokenize, dirs["generate"], dirs["tokenize"], console=console, log=log),
        "train": lambda: train.run(cfg.train, dirs["tokenize"], dirs["train"].parent, console=console, log=log),
        "eval": lambda: evaluate.run(cfg.eval, dirs["train"], dirs["eval"], log=log),
    }
    results = {}
    chosen = selected(from_stage, until)
    for stage in chosen:
        if cfg.store:
            before = STAGES[STAGES.index(stage) - 1] if stage != STAGES[0] else None
            for needed in ([before] if before and before not in chosen else []) + [stage]:
                fetch_verified(dirs[needed], _remote(cfg.store, needed), log)
        results[stage] = steps[stage]()
        if cfg.store:
            from flashdraft.artifact.store import open_store
            from flashdraft.artifact.sync import push

            log(push(dirs[stage], open_store(_remote(cfg.store, stage)), log=log).line())
    return results


def _remote(store: str, stage: str) -> str:
    return f"{store.rstrip('/')}/{stage}"


def fetch_verified(local: Path, remote: str, log: Callable[[str], None]) -> bool:
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


KEY_STATS = {
    "generate": ("records", "errors", "truncated"),
    "tokenize": ("samples", "tokens", "loss_fraction"),
    "train": ("steps", "final_loss"),
    "eval": ("acceptance_length", "speedup", "lossless"),
}


def pipeline_status(cfg: PipelineConfig, store: str | None = None) -> list[dict[str, Any]]:
    """Each stage's artifact as it is now — verified or not, why, key stats — locally and in `store`.
    Everything is checked at call time; nothing is taken from what a stage once printed."""
    from flashdraft.artifact.manifest import read_manifest, verify_dir

    rows = []
    for stage, path in artifact_dirs(cfg).items():
        problems = verify_dir(path)
        stats = read_manifest(path).stats if not problems else {}
        row = {
            "stage": stage,
            "where": "local",
            "artifact": str(path),
            "verified": not problems,
            "reason": str(problems[0]) if problems else "manifest verifies (every file re-hashed)",
            "stats": {k: stats[k] for k in KEY_STATS[stage] if k in stats},
        }
        rows.append(row)
        if store:
            from flashdraft.artifact.store import open_store
            from flashdraft.artifact.sync import verify_store

            remote = f"{store.rstrip('/')}/{stage}"
            remote_problems = verify_store(open_store(remote))
            reason = str(remote_problems[0]) if remote_problems else "listing and checksums match"
            rows.append(
                {**row, "where": "store", "artifact": remote, "verified": not remote_problems, "reason": reason}
            )
    return rows


def status_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# flashdraft status",
        "",
        "Generated from checks run now, not from what a stage reported.",
        "",
        "| stage | where | artifact | verified | reason | stats |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        stats = ", ".join(f"{k} {v}" for k, v in r["stats"].items())
        lines.append(f"| {r['stage']} | {r['where']} | `{r['artifact']}` | {'yes' if r['verified'] else 'NO'} | "
                     f"{r['reason']} | {stats} |")  # fmt: skip
    return "\n".join(lines) + "\n"

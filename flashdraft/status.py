"""`flashdraft status`: each stage's artifact as it is now — verified or not, why, key stats — locally and
in the store. Everything is checked at call time; nothing is taken from what a stage once printed.

    flashdraft status --config examples/qwen3-8b.yaml --store s3://bucket/run1 [--json]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from flashdraft.config import PipelineConfig
from flashdraft.layout import STAGES, generate_parts, join, stage_dir, stage_url

KEY_STATS = {
    "generate": ("records", "errors", "truncated"),
    "tokenize": ("samples", "tokens", "loss_fraction"),
    "train": ("steps", "final_loss"),
    "eval": ("acceptance_length", "speedup", "lossless"),
}


def pipeline_status(cfg: PipelineConfig, store: str | None = None) -> list[dict[str, Any]]:
    """One row per stage and place (local, and the store when given)."""
    from flashdraft.artifact.manifest import read_manifest, verify_dir

    rows = []
    places = [("generate", part) for part in generate_parts(cfg.generate.num_shards)]  # one row per shard
    places += [(stage, None) for stage in STAGES[1:]]
    for stage, part in places:
        path = stage_dir(cfg.workdir, stage) if part is None else Path(cfg.workdir) / part
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

            remote = stage_url(store, stage) if part is None else join(store, part)
            remote_problems = verify_store(open_store(remote))
            reason = str(remote_problems[0]) if remote_problems else "listing and checksums match"
            rows.append(
                {**row, "where": "store", "artifact": remote, "verified": not remote_problems, "reason": reason}
            )
    return [redacted(row) for row in rows]


def redacted(row: dict[str, Any]) -> dict[str, Any]:
    """A row as it may be shown or written: no credentials in its URLs or reasons."""
    from flashdraft.redact import redact

    return {**row, "artifact": redact(row["artifact"]), "reason": redact(row["reason"])}


def status_table(rows: list[dict[str, Any]]) -> Table:
    """The rows as a terminal table: verified or not (with the first problem), and the key stats."""
    table = Table(title="status (checked now)")
    for column in ("stage", "where", "artifact", "verified", "stats"):
        table.add_column(column)
    for row in rows:
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in row["stats"].items())
        verdict = "yes" if row["verified"] else f"no: {row['reason']}"
        table.add_row(row["stage"], row["where"], row["artifact"], verdict, shown)
    return table


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
        verified = "yes" if r["verified"] else "NO"
        lines.append(f"| {r['stage']} | {r['where']} | `{r['artifact']}` | {verified} | {r['reason']} | {stats} |")
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)

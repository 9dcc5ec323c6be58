"""`flashdraft status`: each stage's artifact as it is now — verified or not, why, key stats — locally and
in the store. Everything is checked at call time; nothing is taken from what a stage once printed.

A local artifact that is not there yet is told apart from the outputs alone: **running** (a live process holds its
lock: which program, pid, host, since when), **interrupted** (partial output, nobody holds the lock: a killed run,
which the same command resumes), or **not started**. A generate in progress shows its committed batches of the
total, a train its newest checkpoint and step of the total, each with a rate and an ETA from when that run started.

    flashdraft status --config examples/qwen3-8b.yaml --store s3://bucket/run1 [--json]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from flashdraft.config import PipelineConfig
from flashdraft.layout import STAGES, generate_parts, join, stage_dir, stage_url, train_dir

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
        if problems:
            row["progress"] = work_in_progress(stage, path, cfg)
            if row["progress"]["state"] != "built, does not verify":
                row["reason"] = describe_progress(row["progress"])
        rows.append(row)
        if store:
            remote = stage_url(store, stage) if part is None else join(store, part)
            rows.append(store_row(stage, remote))
    return [redacted(row) for row in rows]


def store_row(stage: str, remote: str) -> dict[str, Any]:
    """The store's copy of a stage's artifact, told by what the store holds: verified (with the stats of the
    store's own manifest), not there or not verifying (`verified` False), or not checkable from here — no
    credentials, the endpoint down (`verified` None: "cannot check" is not "not verified")."""
    from flashdraft.artifact.manifest import MANIFEST, parse_manifest
    from flashdraft.artifact.store import StoreError, open_store
    from flashdraft.artifact.sync import verify_store

    row = {"stage": stage, "where": "store", "artifact": remote, "stats": {}}
    try:
        store = open_store(remote)
        raw = store.read_bytes(MANIFEST)
    except StoreError as e:
        return {**row, "verified": None, "reason": f"cannot check: {e}"}
    if raw is None:
        return {**row, "verified": False, "reason": f"not there: no {MANIFEST} (never pushed, or deleted)"}
    problems = verify_store(store)  # a manifest that does not parse is one of its problems
    if problems:
        return {**row, "verified": False, "reason": str(problems[0])}
    stats = parse_manifest(raw).stats
    return {**row, "verified": True, "reason": "listing and checksums match",
            "stats": {k: stats[k] for k in KEY_STATS[stage] if k in stats}}


def work_in_progress(stage: str, path: Path, cfg: PipelineConfig) -> dict[str, Any]:
    """What a stage's output that does not verify is: running, interrupted, not started, or built but broken;
    with how far it got (generate: batches, train: steps and its newest checkpoint), a rate and an ETA."""
    from flashdraft.artifact.manifest import MANIFEST
    from flashdraft.artifact.ownership import lock_holder, read_marker

    out = train_dir(cfg.workdir) if stage == "train" else path  # train locks its whole --out
    holder = lock_holder(out)
    marker = read_marker(out) if out.is_dir() else {}
    info: dict[str, Any] = {}
    if stage == "generate" and (total := count(marker.get("batches"))):
        done = sum(1 for f in path.glob("batch-*.jsonl") if not f.name.endswith(".errors.jsonl"))
        info = {"done": done, "total": total, "unit": "batches",
                "at_start": count(marker.get("committed_at_start")) or 0, "started": marker.get("started")}
    elif stage == "train" and (total := count(marker.get("total_steps"))):
        from flashdraft.train.checkpoint import checkpoint_dirs

        newest = next(iter(checkpoint_dirs(out)), None)
        info = {"done": last_logged_step(out / "metrics.jsonl"), "total": total, "unit": "steps",
                "at_start": count(marker.get("start_step")) or 0, "started": marker.get("started"),
                "checkpoint": newest.name if newest is not None else None,
                "feature_source": marker.get("feature_source") if marker.get("feature_source") in FEATURE_SOURCES
                else None}
    if holder is not None:
        state = "running"
    elif (path / MANIFEST).exists():
        state = "built, does not verify"
    elif info or (out.is_dir() and any(out.iterdir())):
        state = "interrupted"
    else:
        state = "not started"
    progress = {"state": state, **info}
    if holder:
        from flashdraft.artifact.manifest import shown

        progress["holder"] = {k: holder[k] if count(holder[k]) is not None else shown(str(holder[k]))
                              for k in ("program", "pid", "host", "since") if k in holder}
    if state == "running" and info.get("started"):
        progress.update(rate_and_eta(info))
    return progress


FEATURE_SOURCES = ("transformers", "engine")  # what a train marker may say of its features' source


def count(value: Any) -> int | None:
    """A count read from an owner marker, or None for anything that is not a non-negative whole number (a marker
    is a file in the output: damaged or edited, it says nothing about progress rather than breaking status)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def last_logged_step(metrics: Path) -> int:
    """The step of metrics.jsonl's last complete line (0 when there is none)."""
    from flashdraft.train.metrics import complete_records

    records = complete_records(metrics)
    return records[-1][1]["step"] if records else 0


def rate_and_eta(info: dict[str, Any]) -> dict[str, Any]:
    """Units a minute since this run started, and the seconds left at that rate (none before the first unit)."""
    from datetime import UTC, datetime

    try:
        elapsed = (datetime.now(UTC) - datetime.fromisoformat(info["started"])).total_seconds()
    except (TypeError, ValueError):
        return {}
    made = info["done"] - info.get("at_start", 0)
    if made <= 0 or elapsed <= 0:
        return {}
    per_s = made / elapsed
    return {"rate_per_min": round(per_s * 60, 2), "eta_s": round(max(0, info["total"] - info["done"]) / per_s)}


def describe_progress(p: dict[str, Any]) -> str:
    """One phrase: `running — flashdraft generate (pid 12 on gpu-a, since …): 3 of 53 batches, 1.2 a minute,
    ETA 41 min`, `interrupted: 3 of 53 batches committed; rerun the same command to resume`, `not started`."""
    how_far = f"{p['done']} of {p['total']} {p['unit']}" if "total" in p else ""
    if p.get("checkpoint"):
        how_far += f", newest checkpoint {p['checkpoint']}"
    if p.get("feature_source") == "engine":
        how_far += ", target features from vLLM"
    elif p.get("unit") == "steps":
        how_far += ", no checkpoint yet"
    if p["state"] == "running":
        h = p.get("holder") or {}
        who = (f"{h.get('program', '?')} (pid {h.get('pid', '?')} on {h.get('host', '?')}, since {h.get('since', '?')})"
               if h else "a process (it has not named itself yet)")
        pace = (f", {p['rate_per_min']:g} {p['unit']} a minute, ETA {_duration(p['eta_s'])}"
                if "eta_s" in p else "")
        return f"running — {who}" + (f": {how_far}{pace}" if how_far else "")
    if p["state"] == "interrupted":
        return "interrupted" + (f": {how_far}" if how_far else ": partial output") + \
            " — no process holds its lock; rerun the same command to resume"
    return "not started"


def _duration(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 90 else f"{minutes / 60:.1f} h"


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
        verdict = ("yes" if row["verified"] else row["reason"] if row["verified"] is None
                   else f"no: {row['reason']}")
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
        verified = "yes" if r["verified"] else "cannot check" if r["verified"] is None else "NO"
        lines.append(f"| {r['stage']} | {r['where']} | `{r['artifact']}` | {verified} | {r['reason']} | {stats} |")
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)

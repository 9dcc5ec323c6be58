"""generate's run: claim the output, batch the prompts, generate each batch not yet committed (with its upload,
under a writer lease, as it finishes), then finalize: the merged errors, the manifest, verified.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import (
    MANIFEST,
    FileEntry,
    Lineage,
    ManifestError,
    check_done,
    commit,
    content_digest,
    digest_file,
    identity,
    read_manifest,
    sha256_json,
    verify_dir,
)
from flashdraft.artifact.ownership import (
    OWNER,
    adopt,
    mark_output,
    now_iso,
    output_lock,
    read_marker,
    refuse_overlap,
    remove_inside,
)
from flashdraft.artifact.ownership import claim_output as claim_output_of_kind
from flashdraft.config import GenerateConfig
from flashdraft.errors import BadInput, ExpectedFailure
from flashdraft.generate.backends import make_backend
from flashdraft.generate.batches import (
    batch_ids,
    batch_name,
    batch_prompts,
    commit_batch,
    errors_name,
    jsonl,
    read_batch,
    uncommitted,
)
from flashdraft.generate.prompts import (
    BUILTIN,
    PromptSet,
    builtin_prompts,
)
from flashdraft.generate.turns import regenerate
from flashdraft.progress import progress

LEGACY_CLAIM = ".flashdraft-generate.json"  # flashdraft ≤ 0.1's in-progress marker (now the owner marker's lineage)


class OutputInUse(ExpectedFailure):
    """--out already holds output of a different run; mixing the two would corrupt both."""


def source_digest(source: str) -> str:
    """What the prompts are, by content: lineage input of the completions artifact."""
    if source.startswith(BUILTIN):
        return sha256_json(builtin_prompts(source[len(BUILTIN) :]))
    return content_digest(source)


# How requests are made and how many may fail, not what is generated: changing them keeps the lineage, so a
# run can be resumed with other endpoints or a looser error tolerance.
NOT_LINEAGE = {"base_urls", "concurrency", "max_retries", "timeout_s", "max_error_fraction"}


def lineage_for(cfg: GenerateConfig) -> Lineage:
    """The prompts by content; the settings; a local model by its identity (its manifest or files' content), so weights
    changed in place are another generation. A served model (openai) is named by its server."""
    model = identity(cfg.model) if cfg.backend != "openai" else cfg.model
    return Lineage(inputs=[source_digest(cfg.prompts)],
                   config=sha256_json({**cfg.model_dump(exclude=NOT_LINEAGE), "model": model}))


class GenerationIncomplete(ExpectedFailure):
    """More requests failed than generate.max_error_fraction allows: no manifest, a rerun retries them."""


def claim_output(out: Path, lineage: Lineage) -> None:
    """Mark `out` as this run's, or refuse if it holds anything else (another run's batches, a user's files).

    A finished run of the same lineage that no longer verifies is reopened: the files its manifest names that
    fail are removed (and regenerated), the rest kept.
    """
    legacy = out / LEGACY_CLAIM  # a run that flashdraft ≤ 0.1 started and did not finish
    adopt(out, "completions", made_before_markers=legacy.is_file(),
          lineage=json.loads(legacy.read_text()) if legacy.is_file() else None)
    claim_output_of_kind(out, "completions")  # refuses a directory that is not a completions output
    if (out / MANIFEST).is_file():
        try:
            previous = read_manifest(out)
        except ManifestError:
            previous = None
        if previous is None or not previous.lineage.same_work(lineage):
            raise OutputInUse(f"{out} holds a finished run with different prompts or settings; use another --out")
        for problem in verify_dir(out):
            remove_inside(out, problem.path)  # only a file the manifest names, inside out
        mark_output(out, "completions", lineage=lineage.model_dump())
        (out / MANIFEST).unlink()
        return
    marker = read_marker(out).get("lineage")
    if marker is not None:
        if Lineage.model_validate(marker).same_work(lineage):
            return
        raise OutputInUse(f"{out} holds batches of a run with different prompts or settings; use another --out")
    mark_output(out, "completions", lineage=lineage.model_dump())


def run(
    cfg: GenerateConfig,
    out: Path,
    *,
    upload_to: str | None = None,
    console: Console | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Generate into `out`; returns the manifest's stats. Skips entirely when `out` is done and verifies."""
    out = Path(out)
    refuse_overlap(out, [cfg.prompts])
    with output_lock(out):  # one writer per output for the whole run
        return _run_locked(cfg, out, upload_to, console, log)


def _run_locked(cfg: GenerateConfig, out: Path, upload_to: str | None, console, log) -> dict[str, Any]:
    lineage = lineage_for(cfg)
    decision = check_done(out, lineage)
    log(decision.line("generate", out))
    if decision.done:
        return json.loads((out / MANIFEST).read_text())["stats"]
    claim_output(out, lineage)

    # Two streaming passes over the prompt file, so memory holds ids, not 900K prompts: the first finds this
    # shard's prompts (and the hf target's too-long ones) and so the batches; the second reads the prompts of
    # the batches still to do, as it reaches them.
    prompt_set = PromptSet()
    batches = batch_ids(cfg, prompt_set, log)
    if not batches and not prompt_set.valid:
        atomic_write_text(out / "rejected.jsonl", jsonl([r.to_json() for r in prompt_set.rejected]))
        raise BadInput(f"no prompts in {cfg.prompts}: {len(prompt_set.rejected)} line(s) rejected "
                       f"(reasons in {out / 'rejected.jsonl'}); nothing to generate")
    todo = {k: missing for k in range(len(batches)) if (missing := uncommitted(out, k, batches[k]))}
    retried = sum(1 for k in todo if (out / batch_name(k)).is_file())
    # What `flashdraft status` reads of a run in progress: how many batches, how many there were at this start.
    mark_output(out, "completions", lineage=lineage.model_dump(), batches=len(batches),
                committed_at_start=len(batches) - len(todo), started=now_iso())
    log(
        f"generate: {sum(map(len, batches))} prompts (shard {cfg.shard_index}/{cfg.num_shards}), {len(batches)} "
        f"batches, {len(batches) - len(todo)} already committed, {retried} with failed requests to retry; "
        f"{len(prompt_set.rejected)} rejected lines, {prompt_set.duplicates} duplicates dropped"
    )
    store = _open_upload_store(upload_to)
    with _upload_lease(store, log) as lease:  # batches land one by one: one writer, never under a live manifest
        if store is not None and todo:
            from flashdraft.artifact.prefix import open_for_writing

            open_for_writing(store, "completions", lineage)
        if todo:
            _generate_batches(cfg, out, batches, todo, store, lease, console, log)
        stats = _finalize(out, len(batches), prompt_set, lineage, cfg)
        log(
            f"generate: done, verified — {out}: {stats['records']} records, {stats['errors']} errors, "
            f"{stats['rejected']} rejected, {stats['truncated']} truncated, {stats['completion_tokens']:,} tokens; "
            f"{stats['assistant_turns']} assistant turns regenerated; thinking on {stats['thinking_on']}, "
            f"off {stats['thinking_off']}"
        )
        if store is not None:
            from flashdraft.artifact.sync import push

            log(push(out, store, log=log, lease=lease).line())
    return stats


def _generate_batches(cfg: GenerateConfig, out: Path, batches: list[list[str]], todo: dict[int, list[str]], store,
                      lease, console, log) -> None:
    backend = make_backend(cfg, log)
    total, tokens, started = sum(len(ids) for ids in todo.values()), 0, time.perf_counter()
    with progress(console, "generate {task.fields[tps]} tok/s", total=total, unit="prompts", tps="–") as update:
        for k, batch in batch_prompts(cfg, batches, set(todo)):
            missing = set(todo[k])
            prompts = [p for p in batch if p.id in missing]
            answered = regenerate(backend, prompts, cfg.turns, seed=cfg.seed + k)
            commit_batch(out, k, batches[k], prompts, answered, backend.model_name, cfg)
            completions = [done for _, done in answered]
            if store is not None:
                _upload_now(store, lease, out, [batch_name(k)])
            tokens += sum(c.completion_tokens for c in completions if c.error is None)
            update(advance=len(prompts), tps=f"{tokens / (time.perf_counter() - started):,.0f}")


def _finalize(out: Path, num_batches: int, prompt_set, lineage: Lineage, cfg: GenerateConfig) -> dict[str, Any]:
    """Merge errors, write rejected lines, count from the committed files themselves, and commit the manifest
    unless more requests failed than `max_error_fraction` allows (then: no manifest, and a rerun retries)."""
    errors: list[str] = []
    stats = {"records": 0, "truncated": 0, "completion_tokens": 0, "prompt_tokens": 0, "stray_think_markers": 0,
             "thinking_on": 0, "thinking_off": 0, "assistant_turns": 0}
    for k in range(num_batches):
        records = read_batch(out, k)
        for record in records:
            stats["records"] += 1
            stats["thinking_on" if record["sampling"]["thinking"] else "thinking_off"] += 1
            regenerated = record.get("turns") == "all"
            stats["assistant_turns"] += 1 + regenerated * sum(m["role"] == "assistant" for m in record["messages"])
            stats["truncated"] += record["finish_reason"] == "length"
            stats["completion_tokens"] += record["completion_tokens"]
            stats["prompt_tokens"] += record["prompt_tokens"]
            stats["stray_think_markers"] += record["stray_think_markers"] > 0
        if (out / errors_name(k)).is_file():
            done = {r["id"] for r in records}
            lines = (out / errors_name(k)).read_text().splitlines(keepends=True)
            errors.extend(line for line in lines if json.loads(line)["id"] not in done)
    atomic_write_text(out / "errors.jsonl", "".join(errors))
    atomic_write_text(out / "rejected.jsonl", jsonl([r.to_json() for r in prompt_set.rejected]))
    stats |= {
        "errors": len(errors),
        "rejected": len(prompt_set.rejected),
        "duplicates": prompt_set.duplicates,
        "batches": num_batches,
        "shard": [cfg.shard_index, cfg.num_shards],
    }
    requests = stats["records"] + stats["errors"]
    if stats["errors"] > cfg.max_error_fraction * requests:
        reason = json.loads(errors[0])["reason"]
        raise GenerationIncomplete(
            f"{stats['errors']} of {requests} requests failed (first: {reason}); they are listed in "
            f"{out / 'errors.jsonl'}. No manifest was written: rerun the same command to retry them (committed "
            f"records are kept), or allow some with generate.max_error_fraction (now {cfg.max_error_fraction:g})"
        )
    commit(out, "completions", stats=stats, lineage=lineage)
    (out / OWNER).unlink(missing_ok=True)
    (out / LEGACY_CLAIM).unlink(missing_ok=True)
    return stats


def _open_upload_store(url: str | None):
    if url is None:
        return None
    from flashdraft.artifact.store import open_store

    return open_store(url)


@contextmanager
def _upload_lease(store, log) -> Iterator[Any]:
    """What every write to the upload store happens under, from the first batch to the final push: the prefix's
    writer lease (S3), or the store directory's lock (a local store), as `sync push` takes them. None without a
    store."""
    if store is None:
        yield None
        return
    from flashdraft.artifact.prefix import LocalLease, WriterLease
    from flashdraft.artifact.store import LocalStore

    if isinstance(store, LocalStore):
        with output_lock(store.root), LocalLease() as lease:
            yield lease
        return
    with WriterLease(store, log, program="flashdraft generate --upload-to") as lease:
        yield lease


def _upload_now(store, lease, out: Path, names: list[str]) -> None:
    """Push freshly committed batch files as they land; the final push skips them and verifies all. Each is written
    only while this run holds the prefix's lease and the prefix has no manifest, and only over the version of the
    object that was there just before (a conditional write), as `sync push` writes."""
    from flashdraft.artifact.manifest import Problem
    from flashdraft.artifact.prefix import VerifyFailed

    for name in names:
        lease.check()
        if store.read_bytes(MANIFEST) is not None:
            raise VerifyFailed(store.url, [Problem(MANIFEST, "an artifact was committed here while generate uploaded "
                                                             "its batches; nothing more was written")])
        digest = digest_file(out / name)
        entry = FileEntry(path=name, size=(out / name).stat().st_size, sha256=digest.sha256, crc64nvme=digest.crc64nvme)
        before = store.listed(name)
        store.upload(out / name, entry, lambda n: None, if_match=before.etag if before else None,
                     if_absent=before is None)

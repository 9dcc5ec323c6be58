"""generate: regenerate every prompt's response with the target — resumable, shardable, nothing lost.

    flashdraft generate --prompts prompts.jsonl --out work/generate [--backend hf|openai|vllm]
    flashdraft generate --prompts p.jsonl --out gen-0 --shard-index 0 --num-shards 4 --upload-to s3://b/run/gen-0

Output artifact (kind `completions`):
    batch-000000.jsonl …    one record per prompt, each file committed atomically as its batch finishes
    batch-000000.errors.jsonl  requests that failed after retries (only where there were some)
    errors.jsonl            all of those, merged        rejected.jsonl  input lines that are not prompts
    manifest.json           written last; stats `records`, `errors`, `rejected`, `truncated`, `completion_tokens`

A rerun skips committed batches, so after a crash at any moment it ends with exactly one record per prompt.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
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
from flashdraft.generate.backends import Completion, context_rejections, make_backend
from flashdraft.generate.prompts import (
    BUILTIN,
    Prompt,
    PromptSet,
    Rejected,
    builtin_prompts,
    in_shard,
    iter_prompts,
    thinking_for,
)
from flashdraft.generate.turns import regenerate
from flashdraft.progress import progress

LEGACY_CLAIM = ".flashdraft-generate.json"  # flashdraft ≤ 0.1's in-progress marker (now the owner marker's lineage)


class OutputInUse(ExpectedFailure):
    """--out already holds output of a different run; mixing the two would corrupt both."""


def batch_name(index: int) -> str:
    return f"batch-{index:06d}.jsonl"


def errors_name(index: int) -> str:
    return f"batch-{index:06d}.errors.jsonl"


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


def to_record(prompt: Prompt, history: list[dict[str, Any]], done: Completion, model: str,
              cfg: GenerateConfig) -> dict[str, Any]:
    """`messages`: the history the final completion answered (with `turns: all`, its assistant turns are the
    target's own); `sampling.thinking`: this record's mode, which tokenize renders it in."""
    record = {
        "id": prompt.id,
        "messages": history,
        "turns": cfg.turns,
        "reasoning": done.reasoning,
        "content": done.content,
        "finish_reason": done.finish_reason,
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "token_ids": done.token_ids,
        "stray_think_markers": done.stray_think_markers,
        "model": model,
        "sampling": {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                     "thinking": prompt.thinking},
    }
    if done.tool_calls:
        record["tool_calls"] = done.tool_calls
    if prompt.tools:
        record["tools"] = prompt.tools
    if prompt.category:
        record["category"] = prompt.category
    return record


def jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


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


CONTEXT_CHUNK = 1024  # prompts checked against the hf target's context at a time


def shard_prompts(cfg: GenerateConfig, tally: PromptSet) -> Iterator[Prompt]:
    """This shard's prompts in file order (at most max_prompts), each in its thinking mode; read as a stream."""
    kept = 0
    for p in iter_prompts(cfg.prompts, tally):
        tally.valid += 1
        if in_shard(p.id, cfg.shard_index, cfg.num_shards) and (cfg.max_prompts is None or kept < cfg.max_prompts):
            kept += 1
            yield replace(p, thinking=thinking_for(p, cfg.thinking, cfg.thinking_ratio))


def batch_ids(cfg: GenerateConfig, tally: PromptSet, log) -> list[list[str]]:
    """Pass 1: the ids of every batch, in order. Prompts too long for the hf target's context are rejected
    (into `tally`) before batching, so batches never change between runs."""
    ids, too_long = [], []
    stream = shard_prompts(cfg, tally)
    while chunk := list(itertools.islice(stream, CONTEXT_CHUNK)):
        rejected = context_rejections(cfg, chunk, log)
        too_long.extend(Rejected(None, rejected[p.id], id=p.id) for p in chunk if p.id in rejected)
        ids.extend(p.id for p in chunk if p.id not in rejected)
    tally.rejected.extend(too_long)
    return [ids[i : i + cfg.batch_size] for i in range(0, len(ids), cfg.batch_size)]


def batch_prompts(cfg: GenerateConfig, batches: list[list[str]], wanted: set[int]
                  ) -> Iterator[tuple[int, list[Prompt]]]:
    """Pass 2: the prompts of each wanted batch, read again from the file as the stream reaches them."""
    if not wanted:
        return
    where = {pid: k for k, ids in enumerate(batches) if k in wanted for pid in ids}
    current, k = [], min(wanted)
    for p in shard_prompts(cfg, PromptSet()):
        if where.get(p.id) != k:
            continue
        current.append(p)
        if len(current) == len(batches[k]):
            if [q.id for q in current] != batches[k]:
                raise BadInput(f"{cfg.prompts} changed while generate ran: rerun to start from what it holds now")
            yield k, current
            wanted = wanted - {k}
            if not wanted:
                return
            current, k = [], min(wanted)
    raise BadInput(f"{cfg.prompts} changed while generate ran (batch {k} is no longer all there): rerun")


def read_batch(out: Path, k: int) -> list[dict[str, Any]]:
    """The records of committed batch k; a file changed after it was committed is named, not trusted."""
    path = out / batch_name(k)
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise BadInput(f"{path}: line {number} is not JSON: the file changed after it was committed; "
                           "delete it and rerun to regenerate that batch") from None
    return records


def uncommitted(out: Path, k: int, batch: list[str]) -> list[str]:
    """The ids of batch k that still need a completion: all of them if the batch was never committed, else
    those whose requests failed (listed in its errors file, not in its batch file)."""
    if not (out / batch_name(k)).is_file():
        return batch
    if not (out / errors_name(k)).is_file():
        return []
    done = {r["id"] for r in read_batch(out, k)}
    return [pid for pid in batch if pid not in done]


def commit_batch(out: Path, k: int, batch: list[str], prompts: list[Prompt],
                 answered: list[tuple[list[dict[str, Any]], Completion]], model: str, cfg: GenerateConfig) -> None:
    """Commit batch k after `prompts` (all of it, or the ones that failed before) were answered.

    First time: the errors file is written before the batch file, whose presence means the whole batch is
    accounted for. A retry adds its successes to the batch file first, then rewrites (or removes) the errors
    file; a crash between leaves a record in both, and the batch file wins (see `_finalize`)."""
    kept = read_batch(out, k) if (out / batch_name(k)).is_file() else []
    new = {p.id: to_record(p, history, c, model, cfg)
           for p, (history, c) in zip(prompts, answered, strict=True) if c.error is None}
    by_id = {r["id"]: r for r in kept} | new
    records = [by_id[pid] for pid in batch if pid in by_id]  # in prompt order, whatever was retried
    failed = [{"id": p.id, "messages": p.messages, "reason": c.error}
              for p, (_, c) in zip(prompts, answered, strict=True) if c.error is not None]
    if not kept and failed:
        atomic_write_text(out / errors_name(k), jsonl(failed))
    atomic_write_text(out / batch_name(k), jsonl(records))
    if kept:
        if failed:
            atomic_write_text(out / errors_name(k), jsonl(failed))
        else:
            (out / errors_name(k)).unlink(missing_ok=True)


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

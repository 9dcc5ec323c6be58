"""generate's batches: which prompts go in each (sharded, deduplicated, checked against the target's context), the
record each answer becomes, and a batch's files committed whole (its records, then its errors).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.config import GenerateConfig
from flashdraft.errors import BadInput
from flashdraft.generate.backends import Completion, context_rejections
from flashdraft.generate.prompts import (
    Prompt,
    PromptSet,
    Rejected,
    in_shard,
    iter_prompts,
    thinking_for,
)


def batch_name(index: int) -> str:
    return f"batch-{index:06d}.jsonl"


def errors_name(index: int) -> str:
    return f"batch-{index:06d}.errors.jsonl"


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

"""tokenize's run: records in chunks through a pool of tokenizer processes (tokenize/workers.py), in order, into
Arrow shards (shards.py); duplicates dropped, the quality gate judged, the manifest committed last; and `--show`.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import Lineage, check_done, identity, read_manifest, sha256_json
from flashdraft.artifact.ownership import commit_dir, hold_output
from flashdraft.config import TokenizeConfig
from flashdraft.errors import BadInput, ExpectedFailure
from flashdraft.progress import progress
from flashdraft.tokenize.offsets import longest_run
from flashdraft.tokenize.records import all_records, expand_inputs, open_source, source_digest
from flashdraft.tokenize.shards import ShardWriter
from flashdraft.tokenize.token_counts import TOKEN_COUNTS
from flashdraft.tokenize.workers import CHUNK, ChunkResult, init_pool_worker, init_worker, no_cyclic_gc, process_chunk

HISTOGRAM_EDGES = [0, 256, 512, 1024, 2048, 3072, 4096, 8192, 16384, 1 << 30]


class QualityGateFailed(ExpectedFailure):
    """Too few supervised tokens: the dataset would train a drafter on almost nothing."""


def _chunks(records: Iterator, size: int) -> Iterator[list]:
    chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def run(
    cfg: TokenizeConfig,
    source: Path | list[Path],
    out: Path,
    *,
    console=None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Tokenize `source` (one input or several, merged into one dataset) into `out`; returns the dataset stats.
    Raises QualityGateFailed below the gate."""
    from flashdraft.model.resolve import resolve_model

    sources = expand_inputs([Path(p) for p in (source if isinstance(source, list) else [source])])
    inputs = [open_source(s) for s in sources]  # each artifact's manifest read once, here
    out = Path(out)
    tokenizer_path = resolve_model(cfg.tokenizer, log=log)
    lineage = Lineage(
        inputs=[source_digest(opened) for opened in inputs],
        config=sha256_json({"tokenize": cfg.model_dump(exclude={"workers"}), "tokenizer": identity(tokenizer_path)}),
    )
    # Locked for the whole run; refused unless it is a dataset (or empty) outside every input.
    with hold_output(out, "dataset", inputs=sources):
        decision = check_done(out, lineage)
        log(decision.line("tokenize", out))
        if decision.done:
            return read_manifest(out).stats
        records, from_generate = all_records(inputs)
        if len(sources) > 1:
            log(f"tokenize: {len(sources)} inputs merged ({', '.join(s.name for s in sources)}), duplicates "
                "dropped by id")
        init = (tokenizer_path, cfg, from_generate)
        load_tokenizer_here(init)  # a tokenizer that cannot load is one line here, not a crash in every worker
        stats: dict[str, Any] = {}
        # Built in a temp sibling and renamed over `out` once it verifies: the old dataset stays whole until then.
        with commit_dir(out, "dataset", stats=stats, lineage=lineage) as building:
            stats |= build(cfg, records, building, init, lineage, console)
            _gate(stats, cfg, out)
    log(
        f"tokenize: done, verified — {out}: {stats['samples']} samples, {stats['tokens']:,} tokens, "
        f"{stats['loss_fraction']:.1%} supervised, {stats['rejected']} rejected, {stats['anchor_valid_samples']} "
        f"with a full block of supervised tokens; {cut_summary(stats, cfg)}"
    )
    return stats


def cut_summary(stats: dict[str, Any], cfg: TokenizeConfig) -> str:
    """What the length limits cost, said every time: samples cut at max_length and the share of tokens thrown
    away, and completions generate stopped at max_new_tokens (kept or dropped)."""
    cut = stats.get("truncated_tokens", 0)
    share = cut / (stats["tokens"] + cut) if stats["tokens"] + cut else 0.0
    capped, fate = stats.get("length_capped", 0), "dropped" if cfg.length_capped == "drop" else "kept"
    return (f"{stats['truncated']} cut at max_length {cfg.max_length:,} ({cut:,} tokens, {share:.1%} of all, "
            f"thrown away), {capped} length-capped by generate ({fate})")


def load_tokenizer_here(init: tuple) -> None:
    """Load the tokenizer in this process before any worker starts: its failure is the run's one-line error."""
    try:
        init_worker(*init)
    except ExpectedFailure:
        raise
    except Exception as e:  # whatever transformers raises for a directory without a usable tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput(f"cannot load a tokenizer from {init[0]}: {first}") from None


def in_order(pool: ProcessPoolExecutor, chunks: Iterator[list], ahead: int) -> Iterator[ChunkResult]:
    """`pool.map` that reads its input lazily: at most `ahead` chunks in flight, results in input order (the
    same output for any number of workers)."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.submit(process_chunk, chunk))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def build(cfg: TokenizeConfig, records: Iterator, out: Path, init: tuple, lineage: Lineage, console
          ) -> dict[str, Any]:
    """Tokenize every record into shards under `out`; returns the dataset stats."""
    workers = cfg.workers or os.cpu_count() or 1
    writer = ShardWriter(out, cfg.rows_per_shard)
    totals = ChunkResult()
    lengths: list[int] = []
    seen_tokens, seen_ids, duplicates = 0, set(), 0
    text = "tokenize {task.completed:,} records, {task.fields[tokens]:,} tokens"
    with progress(console, text, tokens=0) as update, no_cyclic_gc(), ExitStack() as stack:
        if workers == 1:
            results = map(process_chunk, _chunks(records, CHUNK))  # the tokenizer loaded here already
        else:
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=get_context("spawn"),
                                                           initializer=init_pool_worker, initargs=init))
            results = in_order(pool, _chunks(records, CHUNK), ahead=2 * workers)
        try:
            for chunk in results:
                duplicates += drop_seen(chunk, seen_ids, cfg.block_size)
                totals.tokenizer_vocab = chunk.tokenizer_vocab
                writer.add(chunk.rows)
                totals.rejected.extend(chunk.rejected)
                totals.add_counts(chunk)
                chunk_lengths = [len(row.input_ids) for row in chunk.rows]
                lengths.extend(chunk_lengths)
                seen_tokens += sum(chunk_lengths)
                update(advance=len(chunk.rows) + len(chunk.rejected), tokens=seen_tokens)
        except BaseException as e:
            writer.abort()  # the open shard's temp file goes, not into the dataset
            if isinstance(e, BrokenProcessPool):  # a worker died (killed, out of memory): the run ends, no hang
                raise ExpectedFailure(f"a tokenize worker died ({e}); rerun, or use fewer --workers if memory is "
                                      "short") from None
            raise

    tokens, loss_tokens, anchor_valid = int(sum(lengths)), totals.loss_tokens, totals.anchor_valid
    stats = {
        "samples": len(lengths),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "loss_fraction": round(loss_tokens / tokens, 6) if tokens else 0.0,
        "rejected": len(totals.rejected),
        "duplicates": duplicates,
        "truncated": totals.truncated,
        "truncated_tokens": totals.truncated_tokens,
        "length_capped": totals.length_capped,
        "anchor_valid_samples": anchor_valid,
        "block_size": cfg.block_size,
        "prompt_token_mismatches": totals.prompt_mismatches,
        "completion_token_id_mismatches": totals.token_id_mismatches,
        "turns_as_own_samples": totals.turns_as_own_samples,
        "length_histogram": {
            f"{lo}-{hi}": int(n)
            for lo, hi, n in zip(
                HISTOGRAM_EDGES[:-1], HISTOGRAM_EDGES[1:], np.histogram(lengths, HISTOGRAM_EDGES)[0], strict=True
            )
            if n
        },
        "input_kind": "completions" if init[2] else "conversations",
        "tokenizer_vocab": totals.tokenizer_vocab or None,
    }
    atomic_write_text(out / "rejected.jsonl", "".join(json.dumps(r) + "\n" for r in totals.rejected))
    shards = writer.finish(lineage.config)
    stats["shards"] = [{"file": f, **s} for f, s in zip(shards, writer.shard_stats, strict=True)]
    # What train reads instead of scanning every token (on every start, on every rank): see token_counts.
    stats |= {"longest": max(lengths, default=0), "largest_token_id": writer.counts.largest_id,
              "token_counts": TOKEN_COUNTS}
    return stats


def drop_seen(chunk: ChunkResult, seen_ids: set[str], block_size: int) -> int:
    """Drop rows whose id an earlier row had (the same conversation in two inputs), keeping the chunk's counts
    right; returns how many were dropped."""
    kept = []
    for row in chunk.rows:
        if row.id in seen_ids:
            chunk.loss_tokens -= int(row.loss_mask.sum(dtype=np.int64))
            chunk.anchor_valid -= longest_run(row.loss_mask) >= block_size
            continue
        seen_ids.add(row.id)
        kept.append(row)
    dropped, chunk.rows = len(chunk.rows) - len(kept), kept
    return dropped


def _gate(stats: dict[str, Any], cfg: TokenizeConfig, out: Path) -> None:
    fraction = stats["loss_fraction"]
    kept = f"No manifest was written and {out} was not changed"
    if stats["samples"] == 0 and stats["rejected"] == 0:
        raise QualityGateFailed(f"no usable samples: the input holds no records. {kept}")
    if stats["samples"] == 0:
        raise QualityGateFailed(f"no usable samples: every record was rejected ({stats['rejected']} rejected). "
                                f"{kept}; the reasons: `flashdraft tokenize --input … --out OTHER "
                                "--min-loss-fraction 0` writes them to OTHER/rejected.jsonl")
    if fraction < cfg.min_loss_fraction:
        raise QualityGateFailed(
            f"only {fraction:.1%} of tokens are supervised (gate: {cfg.min_loss_fraction:.0%}): responses are "
            f"probably truncated, empty or missing, or prompts dwarf them. {kept}. Inspect with "
            f"`flashdraft tokenize --input … --out OTHER --min-loss-fraction 0 --show 3`, or lower "
            f"--min-loss-fraction if this is intended."
        )


# ---------------------------------------------------------------------------------------------- inspect


def show(out: Path, n: int, console, tokenizer_ref: str) -> None:
    """Print `n` samples with the supervised tokens highlighted (green) and the rest dim."""
    from datasets import load_from_disk
    from rich.text import Text
    from transformers import AutoTokenizer

    from flashdraft.model.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(tokenizer_ref, log=lambda s: None))
    dataset = load_from_disk(str(out))
    for row in dataset.select(range(min(n, len(dataset)))):
        text = Text()
        for token, supervised in zip(row["input_ids"], row["loss_mask"], strict=True):
            piece = tokenizer.decode([token])
            text.append(piece, style="bold green" if supervised else "dim")
        supervised_count = sum(row["loss_mask"])
        console.rule(f"{row['id']} — {row['num_tokens']} tokens, {supervised_count} supervised")
        console.print(text)

"""tokenize: completions → Arrow training shards with token-exact loss masks, a quality gate, at tokenizer speed.

    flashdraft tokenize --input work/generate --out work/dataset [--tokenizer REF] [--workers N]
    flashdraft tokenize --out work/dataset --show 3        # print samples, supervised tokens highlighted

Each conversation is rendered with the target's own chat template, exactly as serving renders it, and
tokenized once. The loss mask comes from render boundaries, not from searching the text: for a trained
assistant turn i, the template's rendering of turns [:i] with the generation prompt is a prefix of the
rendering of turns [:i+1], so the turn's characters are [len(before), len(through)); the fast tokenizer maps
those character boundaries to token indices (`char_to_token`; for byte-level BPE computed from the token ids,
see `token_offsets`). Supervised = those tokens up to and including the end-of-turn token; the scaffolding
after it (a newline) is not. Tokens are never re-encoded per prefix.

Output: the `datasets.save_to_disk` layout (`datasets.load_from_disk` opens it) with columns `id`,
`input_ids` (int32), `loss_mask` (uint8), `num_tokens`; manifest stats `samples`, `tokens`, `loss_tokens`,
`loss_fraction`, `rejected`, `truncated`, `anchor_valid_samples`, a length histogram and per-shard stats.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.artifact import (
    MANIFEST,
    Lineage,
    atomic_open,
    atomic_write_text,
    build_manifest,
    check_done,
    content_digest,
    identity,
    list_data_files,
    read_manifest,
    sha256_json,
    write_manifest,
)
from flashdraft.config import TokenizeConfig
from flashdraft.progress import progress
from flashdraft.prompts import ROLES, prompt_id
from flashdraft.token_offsets import ByteLengths, encode

CHUNK = 128  # records per unit of work sent to a worker
HISTOGRAM_EDGES = [0, 256, 512, 1024, 2048, 3072, 4096, 8192, 16384, 1 << 30]


class QualityGateFailed(Exception):
    """Too few supervised tokens: the dataset would train a drafter on almost nothing."""


class BadRecord(ValueError):
    pass


# ---------------------------------------------------------------------------------------------- input


def input_records(source: Path) -> tuple[Iterator[tuple[str, int, bytes | dict]], bool]:
    """(records as (file, line, raw JSON or row), whether the input is a generate artifact)."""
    if source.is_dir():
        try:
            kind = read_manifest(source).kind
        except Exception:
            kind = None
        if kind == "completions":
            files = sorted(source.glob("batch-*[0-9].jsonl"))
            return _jsonl_lines(files), True
        files = sorted(p for p in source.iterdir() if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise FileNotFoundError(f"{source} holds no .jsonl / .parquet files (and is not a generate artifact)")
    elif source.is_file():
        files = [source]
    else:
        raise FileNotFoundError(f"input not found: {source}")
    if all(f.suffix == ".parquet" for f in files):
        return _parquet_rows(files), False
    return _jsonl_lines(files), False


def _jsonl_lines(files: list[Path]) -> Iterator[tuple[str, int, bytes | dict]]:
    for path in files:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if raw.strip():
                    yield path.name, number, raw


def _parquet_rows(files: list[Path]) -> Iterator[tuple[str, int, bytes | dict]]:
    import pyarrow.parquet as pq

    for path in files:
        for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield path.name, number, row


def conversation(raw: bytes | dict, from_generate: bool) -> tuple[str, list[dict[str, Any]], list[int] | None, bool]:
    """(id, messages with `reasoning` on assistant turns, the completion's token ids, thinking) or BadRecord."""
    if isinstance(raw, bytes):
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BadRecord(f"not UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise BadRecord(f"malformed JSON: {e.msg} at column {e.colno}") from None
    else:
        record = raw
    if not isinstance(record, dict):
        raise BadRecord("record is not an object")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRecord("messages are missing or empty")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRecord(f"turn {i}: unknown role {m.get('role') if isinstance(m, dict) else m!r}")
        if not isinstance(m.get("content"), str):
            raise BadRecord(f"turn {i}: content is not a string")
        reasoning = m.get("reasoning", m.get("reasoning_content"))
        turn = {"role": m["role"], "content": m["content"]}
        if isinstance(reasoning, str) and reasoning.strip():
            turn["reasoning"] = reasoning
        clean.append(turn)
    token_ids = None
    if from_generate:
        if not isinstance(record.get("content"), str):
            raise BadRecord("completion record has no string `content`")
        final = {"role": "assistant", "content": record["content"]}
        if isinstance(record.get("reasoning"), str) and record["reasoning"].strip():
            final["reasoning"] = record["reasoning"]
        clean.append(final)
        token_ids = record.get("token_ids")
    if not any(m["role"] == "assistant" for m in clean):
        raise BadRecord("no assistant turn to train on")
    thinking = bool((record.get("sampling") or {}).get("thinking", False))
    return str(record.get("id") or prompt_id(clean)), clean, token_ids, thinking


# ---------------------------------------------------------------------------------------------- rendering


@dataclass
class Renderer:
    """The target's chat template, and the character spans of the assistant turns to train on."""

    tokenizer: Any
    stop_ids: set[int]
    reasoning_in_template: bool
    byte_lengths: ByteLengths | None  # token positions from ids alone (byte-level BPE); else offsets
    compiled: Any = None  # the template as apply_chat_template compiles it, when rendering it directly is exact
    variables: dict[str, Any] = field(default_factory=dict)  # what apply_chat_template passes besides messages

    @classmethod
    def load(cls, path: str) -> Renderer:
        # PreTrainedTokenizerFast, not AutoTokenizer: the same tokenizer.json and chat template, without
        # importing torch (seconds per worker process).
        from transformers import PreTrainedTokenizerFast

        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: flashdraft needs a fast tokenizer (tokenizer.json) for offsets: {e}") from None
        stop = {tokenizer.eos_token_id}
        generation = Path(path) / "generation_config.json"  # every end-of-turn id serving stops on
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            stop |= set(eos if isinstance(eos, list) else [eos])
        template = tokenizer.chat_template or ""
        renderer = cls(
            tokenizer,
            {i for i in stop if i is not None},
            "reasoning_content" in template,
            ByteLengths.for_tokenizer(tokenizer.backend_tokenizer),
        )
        renderer.variables = dict(tokenizer.special_tokens_map)
        renderer.compiled = renderer._direct_template()
        return renderer

    def _direct_template(self) -> Any:
        """`apply_chat_template` spends over half its time outside the template (normalizing messages already
        plain here, recomputing the special-token map): ~0.05 ms of ~0.1 ms a render, two renders a sample.
        Rendering transformers' own compiled template with the same variables is exact; it is used only if a
        probe conversation renders identically both ways, else every render goes through apply_chat_template."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.tokenizer.get_chat_template())
        except Exception:  # a private helper: any change in a later transformers means the public path
            return None
        probe = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>&</b>"},
                 {"role": "assistant", "content": "Hello.", "reasoning": "greet"}, {"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "4", "reasoning": "add"}]  # fmt: skip
        for thinking in (False, True):
            for generation_prompt, messages in ((True, probe[:4]), (False, probe)):
                turns = self.template_messages(messages)
                try:
                    direct = self._render_direct(compiled, turns, thinking, generation_prompt)
                    public = self.tokenizer.apply_chat_template(
                        turns, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
                    )
                except Exception:
                    return None
                if direct != public:
                    return None
        return compiled

    def _render_direct(self, compiled: Any, turns: list[dict[str, Any]], thinking: bool, gen_prompt: bool) -> str:
        # apply_chat_template also shows a turn's reasoning_content to templates that read `thinking` (gpt-oss)
        turns = [{"thinking": t["reasoning_content"], **t} if "reasoning_content" in t else t for t in turns]
        return compiled.render(
            messages=turns, tools=None, documents=None, add_generation_prompt=gen_prompt,
            **self.variables, enable_thinking=thinking,
        )  # fmt: skip

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Reasoning goes where the template puts it: `reasoning_content` if the template reads it (Qwen3
        family, which drops earlier turns' reasoning itself), else a think block ahead of the final answer."""
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out = []
        for i, m in enumerate(messages):
            turn = {"role": m["role"], "content": m["content"]}
            if m["role"] == "assistant" and self.reasoning_in_template:
                turn["reasoning_content"] = m.get("reasoning", "") if i == last else ""
            elif i == last and m.get("reasoning"):
                turn["content"] = f"<think>\n{m['reasoning'].strip()}\n</think>\n\n{m['content']}"
            out.append(turn)
        return out

    def render(self, messages: list[dict[str, Any]], thinking: bool, generation_prompt: bool = False) -> str:
        if self.compiled is not None:
            return self._render_direct(self.compiled, messages, thinking, generation_prompt)
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
        )

    def spans(self, messages: list[dict[str, Any]], thinking: bool, final_only: bool) -> tuple[str, list, str, int]:
        """(full text, [(start, end)] of trained turns, the final turn's prompt text, turns skipped as unstable)."""
        msgs = self.template_messages(messages)
        full = self.render(msgs, thinking)
        assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        trained = assistant[-1:] if final_only else assistant
        spans, skipped, prompt_text = [], 0, ""
        for i in trained:
            before = self.render(msgs[:i], thinking, generation_prompt=True)
            through = full if i == len(msgs) - 1 else self.render(msgs[: i + 1], thinking)
            if not (full.startswith(through) and through.startswith(before)):
                # e.g. Qwen3 renders an earlier turn differently once a later user turn exists.
                if i == assistant[-1]:
                    raise BadRecord(f"chat template renders turn {i} differently in context; cannot place its mask")
                skipped += 1
                continue
            spans.append((len(before), len(through)))
            prompt_text = before
        return full, spans, prompt_text, skipped


# ---------------------------------------------------------------------------------------------- masks


def mask_from_spans(encoding: Any, ids: np.ndarray, spans: list[tuple[int, int]], stop_ids: set[int]) -> np.ndarray:
    """Supervised tokens: those starting inside a span, up to and including the span's first stop token."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    for start, end in spans:
        first = _token_at_or_after(encoding, start, end)
        last = _token_at_or_before(encoding, end - 1, start)
        if first is None or last is None or last < first:
            continue
        turn = ids[first : last + 1]
        stops = [int(np.argmax(hit)) for hit in (turn == stop for stop in stop_ids) if hit.any()]
        if stops:
            last = first + min(stops)
        mask[first : last + 1] = 1
    return mask


def _token_at_or_after(encoding: Any, char: int, limit: int) -> int | None:
    while char < limit:
        token = encoding.char_to_token(char)
        if token is not None:
            return token
        char += 1  # a character no token covers (stripped by a normalizer): look at the next one
    return None


def _token_at_or_before(encoding: Any, char: int, limit: int) -> int | None:
    while char >= limit:
        token = encoding.char_to_token(char)
        if token is not None:
            return token
        char -= 1
    return None


PROMPT_CHECK_TOKENS = 8


def _prompt_tail(encoding: Any, prompt_text: str) -> tuple[int, int, str]:
    """(first token checked, prompt length in tokens, the prompt text from that token's start)."""
    end = len(prompt_text)
    n_prompt = _token_at_or_after(encoding, end, end + 64) if end else 0
    n_prompt = len(encoding.ids) if n_prompt is None else n_prompt
    first = max(0, n_prompt - PROMPT_CHECK_TOKENS)
    start = encoding.token_to_chars(first)[0] if n_prompt else 0
    return first, n_prompt, prompt_text[start:]


def longest_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    padded = np.concatenate(([0], mask.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max())


# ---------------------------------------------------------------------------------------------- workers


@dataclass
class ChunkResult:
    rows: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    truncated: int = 0
    prompt_mismatches: int = 0
    token_id_mismatches: int = 0
    unstable_turns: int = 0
    # Stats of the rows, summed in the worker so the parent process only collects and writes
    loss_tokens: int = 0
    anchor_valid: int = 0

    def add_counts(self, other: ChunkResult) -> None:
        """Add `other`'s counters (every int field) to this one's."""
        for f in fields(self):
            if f.type == "int":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_worker: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, cfg: TokenizeConfig, from_generate: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core; no nested thread pools
    _worker.update(renderer=Renderer.load(tokenizer_path), cfg=cfg, from_generate=from_generate)


def _init_pool_worker(tokenizer_path: str, cfg: TokenizeConfig, from_generate: bool) -> None:
    _init_worker(tokenizer_path, cfg, from_generate)
    gc.freeze()  # what is loaded now lives as long as the worker: the cyclic GC need not rescan it
    gc.disable()  # a worker only tokenizes (see _no_cyclic_gc); the process ends with the pool


@contextmanager
def _no_cyclic_gc():
    """Tokenizing allocates many short-lived, acyclic objects (encodings, id lists); cyclic-GC passes over
    them cost ~6 % of the stage (measured). Reference counting frees them either way; the collector's state
    is restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def process_chunk(items: list[tuple[str, int, bytes | dict]]) -> ChunkResult:
    renderer: Renderer = _worker["renderer"]
    cfg: TokenizeConfig = _worker["cfg"]
    from_generate: bool = _worker["from_generate"]
    backend = renderer.tokenizer.backend_tokenizer
    result = ChunkResult()

    prepared = []
    for source, line, raw in items:
        try:
            sample_id, messages, token_ids, thinking = conversation(raw, from_generate)
            full, spans, prompt_text, skipped = renderer.spans(messages, thinking, final_only=from_generate)
        except BadRecord as e:
            result.rejected.append({"file": source, "line": line, "reason": str(e)})
            continue
        except Exception as e:  # a template error on odd input is that record's problem, not the run's
            result.rejected.append({"file": source, "line": line, "reason": f"chat template failed: {e}"})
            continue
        result.unstable_turns += skipped
        prepared.append((source, line, sample_id, full, spans, prompt_text, token_ids))

    encodings = encode(backend, renderer.byte_lengths, [p[3] for p in prepared])
    # Serving tokenizes the prompt alone, so the prompt part of each sample must be exactly those tokens.
    # Tokenizations can only disagree near the boundary (a pre-tokenizer chunk such as "\n\n" split
    # differently), so the prompt is re-encoded from a token start a few tokens back, not from the start.
    tails = [_prompt_tail(enc, p[5]) for p, enc in zip(prepared, encodings, strict=True)]
    tail_encodings = backend.encode_batch_fast([text for _, _, text in tails], add_special_tokens=False)
    for (source, line, sample_id, _, spans, _, token_ids), enc, (first, n_prompt, _), tail in zip(
        prepared, encodings, tails, tail_encodings, strict=True
    ):
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = mask_from_spans(enc, ids, spans, renderer.stop_ids)
        if ids[first:n_prompt].tolist() != tail.ids:
            result.prompt_mismatches += 1
        elif token_ids is not None and ids[n_prompt : n_prompt + len(token_ids)].tolist() != list(token_ids):
            result.token_id_mismatches += 1
        if len(ids) > cfg.max_length:
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            result.truncated += 1
        supervised = int(np.count_nonzero(mask))
        if not supervised:
            result.rejected.append({"file": source, "line": line, "reason": "no supervised tokens left"})
            continue
        result.rows.append((sample_id, ids, mask))
        result.loss_tokens += supervised
        result.anchor_valid += longest_run(mask) >= cfg.block_size
    return result


# ---------------------------------------------------------------------------------------------- output


def _value(dtype: str) -> dict[str, str]:
    return {"dtype": dtype, "_type": "Value"}


# The columns as `datasets.Features.to_dict()` describes them. Written out rather than built with `datasets`,
# whose import costs ~0.4 s per run; a test checks this equals what `datasets` itself produces.
FEATURES = {
    "id": _value("string"),
    "input_ids": {"feature": _value("int32"), "_type": "List"},
    "loss_mask": {"feature": _value("uint8"), "_type": "List"},
    "num_tokens": _value("int32"),
}


def arrow_schema():
    import pyarrow as pa

    fields = [("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
              ("num_tokens", pa.int32())]  # fmt: skip
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})})


class ShardWriter:
    """Arrow IPC stream files named and described as `datasets.save_to_disk` does, each written atomically."""

    def __init__(self, out: Path, rows_per_shard: int) -> None:
        self.out, self.rows_per_shard = out, rows_per_shard
        self.schema = arrow_schema()
        self.pending: list[tuple[str, np.ndarray, np.ndarray]] = []
        self.shard_files: list[str] = []
        self.shard_stats: list[dict[str, Any]] = []

    def add(self, rows: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        self.pending.extend(rows)
        while len(self.pending) >= self.rows_per_shard:
            self._flush(self.pending[: self.rows_per_shard])
            self.pending = self.pending[self.rows_per_shard :]

    def _flush(self, rows: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        import pyarrow as pa

        lengths = np.array([len(ids) for _, ids, _ in rows], dtype=np.int32)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        all_ids = np.concatenate([ids for _, ids, _ in rows]) if rows else np.zeros(0, np.int32)
        all_mask = np.concatenate([m for _, _, m in rows]) if rows else np.zeros(0, np.uint8)
        table = pa.Table.from_arrays(
            [
                pa.array([r[0] for r in rows], pa.string()),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(all_ids, pa.int32())),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(all_mask, pa.uint8())),
                pa.array(lengths, pa.int32()),
            ],
            schema=self.schema,
        )
        name = f"data-{len(self.shard_files):05d}.arrow"  # renamed to -of-N once N is known
        with atomic_open(self.out / name) as f, pa.ipc.new_stream(f, self.schema) as writer:
            writer.write_table(table)
        self.shard_files.append(name)
        self.shard_stats.append(
            {"rows": len(rows), "tokens": int(lengths.sum()), "loss_tokens": int(all_mask.sum(dtype=np.int64))}
        )

    def finish(self, fingerprint: str) -> list[str]:
        if self.pending or not self.shard_files:
            self._flush(self.pending)
            self.pending = []
        n = len(self.shard_files)
        final = [f"data-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
        for old, new in zip(self.shard_files, final, strict=True):
            os.replace(self.out / old, self.out / new)
        info = {"citation": "", "description": "", "features": FEATURES, "homepage": "", "license": ""}
        atomic_write_text(self.out / "dataset_info.json", json.dumps(info, indent=2))
        state = {
            "_data_files": [{"filename": name} for name in final],
            "_fingerprint": fingerprint[:16],
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        atomic_write_text(self.out / "state.json", json.dumps(state, indent=2))
        return final


# ---------------------------------------------------------------------------------------------- stage


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
    source: Path,
    out: Path,
    *,
    console=None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Tokenize `source` into `out`; returns the dataset stats. Raises QualityGateFailed below the gate."""
    from flashdraft.models import resolve_model

    source, out = Path(source), Path(out)
    if not source.exists():
        raise FileNotFoundError(f"input not found: {source}")
    tokenizer_path = resolve_model(cfg.tokenizer, log=log)
    lineage = Lineage(
        inputs=[content_digest(source)],
        config=sha256_json({"tokenize": cfg.model_dump(exclude={"workers"}), "tokenizer": identity(tokenizer_path)}),
    )
    decision = check_done(out, lineage)
    log(decision.line("tokenize", out))
    if decision.done:
        return read_manifest(out).stats
    _clear_output(out)

    records, from_generate = input_records(source)
    workers = cfg.workers or os.cpu_count() or 1
    writer = ShardWriter(out, cfg.rows_per_shard)
    totals = ChunkResult()
    lengths: list[int] = []
    seen_tokens = 0
    init = (tokenizer_path, cfg, from_generate)
    text = "tokenize {task.completed:,} records, {task.fields[tokens]:,} tokens"
    with progress(console, text, tokens=0) as update, _no_cyclic_gc():
        if workers == 1:
            _init_worker(*init)
            results = map(process_chunk, _chunks(records, CHUNK))
            pool = None
        else:
            pool = get_context("spawn").Pool(workers, initializer=_init_pool_worker, initargs=init)
            results = pool.imap(process_chunk, _chunks(records, CHUNK))  # ordered: same output for any N
        try:
            for chunk in results:
                writer.add(chunk.rows)
                totals.rejected.extend(chunk.rejected)
                totals.add_counts(chunk)
                chunk_lengths = [len(ids) for _, ids, _ in chunk.rows]
                lengths.extend(chunk_lengths)
                seen_tokens += sum(chunk_lengths)
                update(advance=len(chunk.rows) + len(chunk.rejected), tokens=seen_tokens)
        finally:
            if pool is not None:
                pool.close()
                pool.join()

    tokens, loss_tokens, anchor_valid = int(sum(lengths)), totals.loss_tokens, totals.anchor_valid
    stats = {
        "samples": len(lengths),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "loss_fraction": round(loss_tokens / tokens, 6) if tokens else 0.0,
        "rejected": len(totals.rejected),
        "truncated": totals.truncated,
        "anchor_valid_samples": anchor_valid,
        "block_size": cfg.block_size,
        "prompt_token_mismatches": totals.prompt_mismatches,
        "completion_token_id_mismatches": totals.token_id_mismatches,
        "unstable_turns_skipped": totals.unstable_turns,
        "length_histogram": {
            f"{lo}-{hi}": int(n)
            for lo, hi, n in zip(
                HISTOGRAM_EDGES[:-1], HISTOGRAM_EDGES[1:], np.histogram(lengths, HISTOGRAM_EDGES)[0], strict=True
            )
            if n
        },
        "input_kind": "completions" if from_generate else "conversations",
    }
    atomic_write_text(out / "rejected.jsonl", "".join(json.dumps(r) + "\n" for r in totals.rejected))
    shards = writer.finish(lineage.config)
    stats["shards"] = [{"file": f, **s} for f, s in zip(shards, writer.shard_stats, strict=True)]
    _gate(stats, cfg)
    write_manifest(out, build_manifest(out, kind="dataset", stats=stats, lineage=lineage))
    log(
        f"tokenize: done, verified — {out}: {stats['samples']} samples, {tokens:,} tokens, "
        f"{stats['loss_fraction']:.1%} supervised, {stats['rejected']} rejected, {stats['truncated']} truncated, "
        f"{anchor_valid} with a full block of supervised tokens"
    )
    return stats


def _gate(stats: dict[str, Any], cfg: TokenizeConfig) -> None:
    fraction = stats["loss_fraction"]
    if stats["samples"] == 0:
        raise QualityGateFailed("no usable samples: every record was rejected (see rejected.jsonl)")
    if fraction < cfg.min_loss_fraction:
        raise QualityGateFailed(
            f"only {fraction:.1%} of tokens are supervised (gate: {cfg.min_loss_fraction:.0%}): responses are "
            f"probably truncated, empty or missing, or prompts dwarf them. No manifest was written. Inspect with "
            f"`flashdraft tokenize --show 3 --out DIR`, or lower --min-loss-fraction if this is intended."
        )


def _clear_output(out: Path) -> None:
    """A rebuild starts from nothing: remove the old manifest first (the artifact stops existing), then data."""
    if not out.exists():
        out.mkdir(parents=True)
        return
    (out / MANIFEST).unlink(missing_ok=True)
    for rel in list_data_files(out):
        (out / rel).unlink()


# ---------------------------------------------------------------------------------------------- inspect


def show(out: Path, n: int, console, tokenizer_ref: str) -> None:
    """Print `n` samples with the supervised tokens highlighted (green) and the rest dim."""
    from datasets import load_from_disk
    from rich.text import Text
    from transformers import AutoTokenizer

    from flashdraft.models import resolve_model

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

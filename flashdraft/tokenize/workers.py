"""The tokenize worker: a chunk of raw records → rows (id, input_ids, loss_mask, prompt_opening) and counts, in
one process each.

Workers are spawned processes holding a loaded Renderer; they parse, render, encode (one `encode_batch_fast`
per chunk), build masks and sum the per-row stats, so the parent only collects rows and writes shards.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from flashdraft.config import TokenizeConfig
from flashdraft.model.resolve import vocab_fingerprint
from flashdraft.records import BadRecord, opening_key
from flashdraft.tokenize.offsets import _token_at_or_after, encode, longest_run, mask_from_spans, prompt_tail
from flashdraft.tokenize.records import Item, conversation
from flashdraft.tokenize.render import Renderer
from flashdraft.tokenize.shards import Row


@dataclass(frozen=True)
class Prepared:
    """A record rendered, waiting for its chunk to be encoded."""

    source: str
    line: int
    id: str
    text: str
    spans: list[tuple[int, int]]
    prompt_text: str
    token_ids: list[int] | None
    opening: int  # the conversation's opening_key, shared by the samples made from its turns
    # generate's max_new_tokens stopped it: what the chat template adds after the target's words is not supervised
    length_capped: bool = False
    generated_end: int | None = None  # where those words end in `text`, when found as written


@dataclass
class ChunkResult:
    rows: list[Row] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    truncated: int = 0  # samples longer than max_length, cut to it
    truncated_tokens: int = 0  # the tokens those cuts threw away
    length_capped: int = 0  # completions generate stopped at max_new_tokens (kept or dropped per the setting)
    prompt_mismatches: int = 0
    token_id_mismatches: int = 0
    turns_as_own_samples: int = 0
    # Stats of the rows, summed in the worker so the parent process only collects and writes
    loss_tokens: int = 0
    anchor_valid: int = 0
    tokenizer_vocab: str = ""  # the tokenizer's vocabulary fingerprint, computed once per worker

    def add_counts(self, other: ChunkResult) -> None:
        """Add `other`'s counters (every int field) to this one's."""
        for f in fields(self):
            if f.type == "int":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


CHUNK = 128  # records per unit of work sent to a worker

_worker: dict[str, Any] = {}


def init_worker(tokenizer_path: str, cfg: TokenizeConfig, from_generate: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core; no nested thread pools
    renderer = Renderer.load(tokenizer_path)
    _worker.update(renderer=renderer, cfg=cfg, from_generate=from_generate, vocab=vocab_fingerprint(renderer.tokenizer))


def init_pool_worker(tokenizer_path: str, cfg: TokenizeConfig, from_generate: bool) -> None:
    init_worker(tokenizer_path, cfg, from_generate)
    gc.freeze()  # what is loaded now lives as long as the worker: the cyclic GC need not rescan it
    gc.disable()  # a worker only tokenizes (see no_cyclic_gc); the process ends with the pool


@contextmanager
def no_cyclic_gc():
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


def process_chunk(items: list[Item]) -> ChunkResult:
    renderer: Renderer = _worker["renderer"]
    cfg: TokenizeConfig = _worker["cfg"]
    from_generate: bool = _worker["from_generate"]
    backend = renderer.tokenizer.backend_tokenizer
    result = ChunkResult(tokenizer_vocab=_worker["vocab"])

    prepared = []
    for source, line, raw in items:
        try:
            record = conversation(raw, from_generate)
            text, spans, prompt_text, own = renderer.spans(record.messages, record.thinking, record.final_only,
                                                           record.tools)
        except BadRecord as e:
            result.rejected.append({"file": source, "line": line, "reason": str(e)})
            continue
        except Exception as e:  # a template error on odd input is that record's problem, not the run's
            result.rejected.append({"file": source, "line": line, "reason": f"chat template failed: {e}"})
            continue
        result.length_capped += record.length_capped
        if record.length_capped and cfg.length_capped == "drop":
            result.rejected.append({"file": source, "line": line, "reason": "length-capped: generate stopped it at "
                                    "max_new_tokens (finish_reason length; tokenize.length_capped: drop)"})
            continue
        result.turns_as_own_samples += len(own)
        opening = opening_key(record.messages)
        cut_at = generated_end(text, spans[-1], record.messages[-1]) if record.length_capped else None
        prepared.append(Prepared(source, line, record.id, text, spans, prompt_text, record.token_ids, opening,
                                 record.length_capped, cut_at))
        prepared.extend(Prepared(source, line, f"{record.id}#turn{i}", own_text, [span], own_prompt, None, opening)
                        for i, own_text, span, own_prompt in own)

    encodings = encode(backend, renderer.byte_lengths, [p.text for p in prepared])
    # Serving tokenizes the prompt alone, so the prompt part of each sample must be exactly those tokens.
    # Tokenizations can only disagree near the boundary (a pre-tokenizer chunk such as "\n\n" split
    # differently), so the prompt is re-encoded from a token start a few tokens back, not from the start.
    tails = [prompt_tail(enc, p.prompt_text) for p, enc in zip(prepared, encodings, strict=True)]
    tail_encodings = backend.encode_batch_fast([text for _, _, text in tails], add_special_tokens=False)
    for p, enc, (first, n_prompt, _), tail in zip(prepared, encodings, tails, tail_encodings, strict=True):
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = mask_from_spans(enc, ids, p.spans, renderer.stop_ids)
        if p.length_capped:
            unsupervise_template_close(mask, enc, ids, p, renderer.stop_ids)
        if ids[first:n_prompt].tolist() != tail.ids:
            result.prompt_mismatches += 1
        elif p.token_ids is not None and ids[n_prompt : n_prompt + len(p.token_ids)].tolist() != list(p.token_ids):
            result.token_id_mismatches += 1
        if len(ids) > cfg.max_length:
            result.truncated_tokens += len(ids) - cfg.max_length
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            result.truncated += 1
        supervised = int(np.count_nonzero(mask))
        if not supervised:
            result.rejected.append({"file": p.source, "line": p.line, "reason": "no supervised tokens left"})
            continue
        result.rows.append(Row(p.id, ids, mask, p.opening))
        result.loss_tokens += supervised
        result.anchor_valid += longest_run(mask) >= cfg.block_size
    return result


def generated_end(text: str, span: tuple[int, int], final_turn: dict[str, Any]) -> int | None:
    """Where a length-capped final turn's own words end in `text`: after its answer, or after its reasoning when
    the cap came before any answer. The template closes the turn after them (Qwen3: "</think>" and an empty answer;
    every template: an end-of-turn token): labels the target never produced. None when the words are not found as
    written (a template that rewrites them)."""
    start, end = span
    for name in ("content", "reasoning"):
        written = final_turn.get(name) or ""
        for words in (written, written.strip()):  # as written, else as a template that strips it renders it
            if words.strip() and (at := text.rfind(words, start, end)) >= 0:
                return at + len(words)
    return None


def unsupervise_template_close(mask: np.ndarray, encoding: Any, ids: np.ndarray, p: Prepared,
                               stop_ids: set[int]) -> None:
    """A capped turn: no supervision from the first token at or after the target's last word; when its words were
    not found as written, at least the last supervised token goes when it is a stop token (the template's)."""
    if p.generated_end is not None:
        first = _token_at_or_after(encoding, p.generated_end, len(p.text))
        if first is not None:
            mask[first:] = 0
        return
    supervised = np.flatnonzero(mask)
    if supervised.size and int(ids[supervised[-1]]) in stop_ids:
        mask[supervised[-1]] = 0

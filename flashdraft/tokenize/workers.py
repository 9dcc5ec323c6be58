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
from flashdraft.tokenize.offsets import encode, longest_run, mask_from_spans, prompt_tail
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


@dataclass
class ChunkResult:
    rows: list[Row] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    truncated: int = 0
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
        result.turns_as_own_samples += len(own)
        opening = opening_key(record.messages)
        prepared.append(Prepared(source, line, record.id, text, spans, prompt_text, record.token_ids, opening))
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
        if ids[first:n_prompt].tolist() != tail.ids:
            result.prompt_mismatches += 1
        elif p.token_ids is not None and ids[n_prompt : n_prompt + len(p.token_ids)].tolist() != list(p.token_ids):
            result.token_id_mismatches += 1
        if len(ids) > cfg.max_length:
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

"""What tokenize reads: a generate artifact's batch files, or plain conversations (JSONL / Parquet), as
(file, line, raw record) items; and one record → (id, messages, completion token ids, thinking).

Raw JSONL lines are parsed in the worker processes, not here: the parent only reads bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from flashdraft.artifact.manifest import MANIFEST, content_digest
from flashdraft.artifact.verified import InputArtifact, open_input
from flashdraft.errors import BadInput
from flashdraft.records import BadRecord, check_tools, check_turn, jsonl_lines, parse_json, prompt_id, turn_extras

Item = tuple[str, int, bytes | dict]  # (file name, 1-based line or row, raw line or parsed row)


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[dict[str, Any]]  # with `reasoning` on assistant turns
    token_ids: list[int] | None  # the completion's token ids, when generate stored them
    thinking: bool  # enable_thinking as the completion was generated
    final_only: bool  # train on the last assistant turn only (the others are not the target's words)
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template in its own tool format
    # generate stopped it at max_new_tokens (finish_reason "length"): the target never closed the turn
    length_capped: bool = False


BATCHES = "batch-*[0-9].jsonl"  # a generate artifact's committed batches
REMEDY = "regenerate it, or pull it from the store again"


def open_source(source: Path) -> Path | InputArtifact:
    """An input as tokenize reads it: an artifact (a directory with a manifest) opened once, its manifest read and
    parsed here, so the lineage names the bytes its files are checked against; plain files stay paths."""
    if source.is_dir() and (source / MANIFEST).exists():
        return open_input(source, "input", REMEDY)
    return source


def source_digest(source: Path | InputArtifact) -> str:
    """The input as the lineage names it: an artifact's manifest digest (of the bytes read once), else its content."""
    return source.digest if isinstance(source, InputArtifact) else content_digest(source)


def source_path(source: Path | InputArtifact) -> Path:
    return source.root if isinstance(source, InputArtifact) else source


def input_records(source: Path | InputArtifact) -> tuple[Iterator[Item], bool]:
    """(records as (file, line, raw JSON or row), whether the input is a generate artifact). An artifact is
    used only if it verifies — its files hashed against the manifest read once, the batches read the ones it lists,
    and each still the file hashed once they are read; a generate run that never finished is refused, not read as
    plain files."""
    if isinstance(source, InputArtifact):
        artifact = source.verified()
        if artifact.manifest.kind == "completions":
            batches = sorted(e.path for e in artifact.manifest.files if fnmatch(e.path, BATCHES))
            return _held_to_hash(_jsonl_lines([artifact.root / name for name in batches]), artifact), True
        source = artifact.root
    if source.is_dir():
        if any(source.glob(BATCHES)) and not (source / MANIFEST).exists():
            raise BadInput(f"{source} is an unfinished generate run (batch files, no manifest): rerun "
                           "`flashdraft generate` with the same --out to finish it, then tokenize")
        files = sorted(p for p in source.iterdir() if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise BadInput(f"{source} holds no .jsonl / .parquet files (and is not a generate artifact)")
    elif source.is_file():
        files = [source]
    else:
        raise BadInput(f"input not found: {source}")
    if all(f.suffix == ".parquet" for f in files):
        return _parquet_rows(files), False
    return _jsonl_lines(files), False


def _held_to_hash(records: Iterator[Item], artifact: InputArtifact) -> Iterator[Item]:
    """The records, then the check that every file read is still the one hashed (a batch replaced while tokenize
    read it fails the run before its dataset is committed)."""
    yield from records
    artifact.require_unchanged()


def expand_inputs(sources: list[Path]) -> list[Path]:
    """The inputs to read: each given path, except that a directory holding only generate artifacts (the shards of
    one prompt set, e.g. gen-0 … gen-N pulled from the store) stands for those artifacts, in name order."""
    expanded = []
    for source in sources:
        if not source.exists():
            raise BadInput(f"input not found: {source}")
        shards = sorted(d for d in source.iterdir() if (d / MANIFEST).is_file()) if source.is_dir() else []
        plain = source.is_dir() and not (source / MANIFEST).exists() and not any(
            p.suffix in (".jsonl", ".json", ".parquet") for p in source.iterdir() if p.is_file())
        expanded.extend(shards if plain and shards else [source])
    return expanded


def all_records(sources: list[Path | InputArtifact]) -> tuple[Iterator[Item], bool]:
    """Every input's records, one after the other (file names prefixed by their input's name when there are
    several); all inputs must be of one kind: generate artifacts, or plain conversations."""
    parts = [(source_path(source), *input_records(source)) for source in sources]  # verified here, before any work
    kinds = {from_generate for _, _, from_generate in parts}
    if len(kinds) > 1:
        raise BadInput("the inputs mix generate artifacts and plain conversation files: tokenize them separately")

    def chained() -> Iterator[Item]:
        for path, records, _ in parts:
            for name, line, raw in records:
                yield (f"{path.name}/{name}" if len(parts) > 1 else name), line, raw

    return chained(), kinds.pop()


def _jsonl_lines(files: list[Path]) -> Iterator[Item]:
    for path in files:
        for number, raw in jsonl_lines(path):
            yield path.name, number, raw


def _parquet_rows(files: list[Path]) -> Iterator[Item]:
    import pyarrow.parquet as pq

    for path in files:
        for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield path.name, number, row


def conversation(raw: bytes | dict, from_generate: bool) -> Conversation:
    """One record as a Conversation, or BadRecord saying why not."""
    record = parse_json(raw)
    if not isinstance(record, dict):
        raise BadRecord("record is not an object")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRecord("messages are missing or empty")
    clean = []
    for i, m in enumerate(messages):
        role, content = check_turn(i, m)
        reasoning = m.get("reasoning", m.get("reasoning_content"))
        turn = {"role": role, "content": content, **turn_extras(i, role, m)}
        if isinstance(reasoning, str) and reasoning.strip():
            turn["reasoning"] = reasoning
        clean.append(turn)
    token_ids = None
    if from_generate:
        if not isinstance(record.get("content"), str):
            raise BadRecord("completion record has no string `content`")
        final = {"role": "assistant", "content": record["content"],
                 **turn_extras(len(clean), "assistant", record)}  # the completion's tool calls, if any
        if isinstance(record.get("reasoning"), str) and record["reasoning"].strip():
            final["reasoning"] = record["reasoning"]
        clean.append(final)
        token_ids = record.get("token_ids")
    if not any(m["role"] == "assistant" for m in clean):
        raise BadRecord("no assistant turn to train on")
    # Each record in its own mode: as generate produced it (`sampling.thinking`), or a plain record's `thinking`.
    thinking = record.get("thinking")
    if not isinstance(thinking, bool):
        thinking = bool((record.get("sampling") or {}).get("thinking", False))
    # A generate record's earlier assistant turns are the dataset's words unless every turn was regenerated.
    final_only = from_generate and record.get("turns", "final") != "all"
    tools = check_tools(record)
    return Conversation(str(record.get("id") or prompt_id(clean, tools)), clean, token_ids, thinking, final_only,
                        tools, from_generate and record.get("finish_reason") == "length")

"""Prompt sets: read JSONL / Parquet / `save_to_disk` directories into normalized chat prompts.

    from flashdraft.generate.prompts import load_prompts
    prompts, rejected, duplicates = load_prompts("data/prompts.jsonl")

Accepted record forms: OpenAI `messages` ([{role, content}]), ShareGPT `conversations` ([{from, value}]), or a
bare `prompt` string. A conversation that ends in an assistant turn regenerates that turn from the history
before it. Each prompt's id is a hash of its normalized messages; duplicates are dropped and counted. Bad
records are returned with their line number and the reason, never silently skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from flashdraft.errors import BadInput
from flashdraft.records import (
    OPENING_WORDS,
    SHAREGPT_ROLES,
    BadRecord,
    check_tools,
    check_turn,
    jsonl_lines,
    parse_json,
    prompt_id,
    turn_extras,
    words,
)

BUILTIN = "builtin:"


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    category: str | None = None
    thinking: bool | None = None  # the record's own mode; generate resolves every prompt's before asking
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas, for the template and the server


def thinking_for(prompt: Prompt, setting: bool | str, ratio: float) -> bool:
    """The mode a prompt is generated (and later rendered) in: its record's own, else the setting; "mixed" draws
    by id, so the same prompt gets the same mode on every machine and rerun."""
    if prompt.thinking is not None:
        return prompt.thinking
    if setting == "mixed":
        return int(prompt.id[:8], 16) / 0x1_0000_0000 < ratio
    return bool(setting)


@dataclass(frozen=True)
class Rejected:
    line: int | None  # 1-based line (JSONL) or row number (Parquet / datasets); None: rejected by id, later
    reason: str
    raw: str = ""
    id: str | None = None
    unreadable: bool = False  # the line is no record at all (not JSON, too long), not a record that does not fit

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "id": self.id, "reason": self.reason, "raw": self.raw[:500]}


@dataclass
class PromptSet:
    prompts: list[Prompt] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    duplicates: int = 0
    valid: int = 0  # prompts that parsed, each id once (counted by generate's streaming pass)


def normalize(record: Any) -> Prompt:
    """One input record → a Prompt, or BadRecord saying why not."""
    if not isinstance(record, dict):
        raise BadRecord(f"record is a {type(record).__name__}, not an object")
    if "messages" in record:
        turns = record["messages"]
        role_key, content_key, role_map = "role", "content", None
    elif "conversations" in record:
        turns = record["conversations"]
        role_key, content_key, role_map = "from", "value", SHAREGPT_ROLES
    elif "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise BadRecord("`prompt` must be a non-empty string")
        turns = [{"role": "user", "content": record["prompt"]}]
        role_key, content_key, role_map = "role", "content", None
    else:
        raise BadRecord("no `messages`, `conversations` or `prompt` field")
    if not isinstance(turns, list) or not turns:
        raise BadRecord("messages are missing or empty")

    messages = []
    for i, turn in enumerate(turns):
        role, content = check_turn(i, turn, role_key, content_key, role_map)
        messages.append({"role": role, "content": content, **turn_extras(i, role, turn)})

    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]  # regenerate the final assistant turn from the history before it
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise BadRecord("nothing to answer: the conversation must end with a user (or tool) turn")
    if not any(m["content"].strip() for m in messages if m["role"] == "user"):
        raise BadRecord("every user turn is empty")
    tools = check_tools(record)
    category = record.get("category")
    thinking = record.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRecord(f"`thinking` must be true or false, not {thinking!r}")
    return Prompt(prompt_id(messages, tools), messages, category if isinstance(category, str) else None, thinking,
                  tools)


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any, str]]:
    """(line number, parsed record or BadRecord, raw text) for every non-blank line."""
    for number, raw in jsonl_lines(path):
        # for rejected.jsonl: what the line says, as far as it can be read
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else ""
        try:
            yield number, parse_json(raw), text
        except BadRecord as e:
            yield number, e, text


def _table_records(path: Path) -> Iterator[tuple[int, Any, str]]:
    if path.is_dir():
        from datasets import load_from_disk

        rows = load_from_disk(str(path))
    else:
        import pyarrow.parquet as pq

        # a record batch at a time: a 900K-prompt file is never one Python list
        rows = (row for batch in pq.ParquetFile(path).iter_batches(batch_size=1024) for row in batch.to_pylist())
    for number, row in enumerate(rows, start=1):
        yield number, row, ""


def read_records(source: str) -> Iterator[tuple[int, Any, str]]:
    if source.startswith(BUILTIN):
        for number, record in enumerate(builtin_prompts(source[len(BUILTIN) :]), start=1):
            yield number, record, ""
        return
    path = Path(source)
    if not path.exists():
        raise BadInput(f"prompts not found: {source}")
    if path.is_dir() or path.suffix == ".parquet":
        yield from _table_records(path)
    else:
        yield from _jsonl_records(path)


def iter_prompts(source: str, tally: PromptSet) -> Iterator[Prompt]:
    """The valid prompts of `source` in order, each id once, read as a stream; the rejected lines and the
    duplicate count go into `tally` (whose `prompts` stays empty: only ids are kept, to drop duplicates)."""
    seen: set[str] = set()
    for number, record, raw in read_records(source):
        try:
            if isinstance(record, BadRecord):
                raise record
            prompt = normalize(record)
        except BadRecord as e:
            tally.rejected.append(Rejected(number, str(e), raw.rstrip("\n"), unreadable=isinstance(record, BadRecord)))
            continue
        if prompt.id in seen:
            tally.duplicates += 1
            continue
        seen.add(prompt.id)
        yield prompt


def load_prompts(source: str) -> PromptSet:
    out = PromptSet()
    out.prompts = list(iter_prompts(source, out))
    return out


def in_shard(prompt_id_hex: str, shard_index: int, num_shards: int) -> bool:
    """Deterministic split by id (not by position), so reordering the input keeps every prompt's shard."""
    return int(prompt_id_hex, 16) % num_shards == shard_index


# ---------------------------------------------------------------------------------------------- built-in set


def user_text(prompt: Prompt) -> str:
    return " ".join(m["content"] for m in prompt.messages if m["role"] == "user")


def templated_like(train: list[Prompt], heldout: list[Prompt]) -> list[str]:
    """The held-out prompts (their user text) that look templated from a training one: the same first three
    words, or a third or more of their word 4-grams found in one training prompt. How the built-in held-out sets
    are kept honest (tested), and how generated prompts are screened against them."""
    def grams(ws: list[str]) -> set[tuple[str, ...]]:
        return {tuple(ws[i : i + 4]) for i in range(len(ws) - 3)}

    seen = [(ws, grams(ws)) for ws in (words(user_text(p)) for p in train)]
    flagged = []
    for p in heldout:
        mine_words = words(user_text(p))
        mine = grams(mine_words)
        for other_words, other_grams in seen:
            n = OPENING_WORDS  # the opening that makes prompts kin (records.opening_key)
            shared_opening = len(mine_words) >= n and mine_words[:n] == other_words[:n]
            if shared_opening or (mine and len(mine & other_grams) >= len(mine) / 3):
                flagged.append(user_text(p))
                break
    return flagged


def builtin_sets() -> list[str]:
    """The names of the built-in prompt sets: the JSONL files shipped in flashdraft/generate/prompt_sets/."""
    return sorted(p.name.removesuffix(".jsonl") for p in _prompt_sets().iterdir() if p.name.endswith(".jsonl"))


def builtin_prompts(name: str) -> list[dict[str, Any]]:
    """A built-in prompt set's records in file order (prompt_sets/README.md says what each set is). Sets joined
    by `+` (`chat+chat-more+chat-extra`, what the demo trains on) are read in turn."""
    if "+" in name:
        return [record for part in name.split("+") for record in builtin_prompts(part)]
    if name not in builtin_sets():
        raise BadInput(f"unknown built-in prompt set {name!r}: use "
                       + ", ".join(f"builtin:{n}" for n in builtin_sets())
                       + ", or several joined by + (builtin:chat+chat-more)")
    text = _prompt_sets().joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _prompt_sets():
    return resources.files("flashdraft.generate").joinpath("prompt_sets")

"""Conversation records as users and `generate` write them: the one reader for JSONL lines and chat turns,
shared by generate (prompts) and tokenize (conversations) so both accept and reject the same input alike.

A bad record raises `BadRecord`; its message is the reason written beside the line number to rejected.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flashdraft.bounded import open_regular

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool"}


class BadRecord(ValueError):
    """A record that cannot be used; the message is the reason written to rejected.jsonl."""


MAX_LINE_BYTES = 64 << 20  # one record; a longer line is rejected (and skipped) without being held in memory


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes | BadRecord]]:
    """(1-based line number, raw bytes) of every non-blank line; a line over MAX_LINE_BYTES comes as its
    BadRecord. Only a regular file is read (a FIFO or a device such as /dev/zero is refused in one line)."""
    with open_regular(path) as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES):
            number += 1
            if len(raw) == MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass  # the rest of the line, read and dropped piece by piece
                yield number, BadRecord(f"line longer than {MAX_LINE_BYTES >> 20} MB")
            elif raw.strip():
                yield number, raw


def parse_json(raw: bytes | dict) -> Any:
    """One JSONL line parsed (a row from Parquet / datasets is already parsed)."""
    if isinstance(raw, BadRecord):  # a line jsonl_lines could not hold
        raise raw
    if not isinstance(raw, bytes):
        return raw
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRecord(f"not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise BadRecord(f"malformed JSON: {e.msg} at column {e.colno}") from None


def check_turn(i: int, turn: Any, role_key: str = "role", content_key: str = "content",
               role_map: dict[str, str] | None = None) -> tuple[str, str]:
    """(role, content) of turn i, or BadRecord naming what is wrong with it."""
    if not isinstance(turn, dict):
        raise BadRecord(f"turn {i} is not an object")
    role = turn.get(role_key)
    role = role_map.get(role, role) if role_map and isinstance(role, str) else role
    if role not in ROLES:
        raise BadRecord(f"turn {i}: unknown role {turn.get(role_key)!r}")
    content = turn.get(content_key)
    if content is None and role == "assistant" and turn.get("tool_calls"):
        content = ""  # OpenAI form: a turn that only calls tools has null content
    if not isinstance(content, str):
        raise BadRecord(f"turn {i}: content is {type(content).__name__}, not a string")
    return role, content


def turn_extras(i: int, role: str, turn: dict[str, Any]) -> dict[str, Any]:
    """The tool fields of turn i (OpenAI form) kept beside role and content: an assistant turn's `tool_calls`
    ([{type: function, function: {name, arguments}}]), a tool turn's `tool_call_id` / `name`."""
    extras: dict[str, Any] = {}
    if role == "assistant" and turn.get("tool_calls") is not None:
        calls = turn["tool_calls"]
        if not isinstance(calls, list) or not calls:
            raise BadRecord(f"turn {i}: tool_calls must be a non-empty list")
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise BadRecord(f"turn {i}: a tool call needs function.name (OpenAI form)")
            if not isinstance(function.get("arguments", {}), str | dict):
                raise BadRecord(f"turn {i}: tool call arguments must be a JSON string or an object")
        extras["tool_calls"] = calls
    if role == "tool":
        extras |= {k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)}
    return extras


def check_tools(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A record's `tools` (OpenAI function schemas), passed to the chat template and the server as they are."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord("`tools` must be a list of tool schemas (objects)")
    return tools or None


def prompt_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """A conversation's stable id: a hash of its messages (and tools, when it has some) in canonical JSON."""
    canonical = json.dumps(messages if tools is None else {"messages": messages, "tools": tools},
                           sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def words(text: str) -> list[str]:
    """Lower-case words and numbers: how prompts are compared for kinship (`opening_key`, `templated_like`)."""
    return re.findall(r"[a-z0-9']+", text.lower())


OPENING_WORDS = 3


def opening_key(messages: list[dict[str, Any]]) -> int:
    """A 64-bit key of the first user turn's first three words. Two prompts with one key are kin (the same
    question with other numbers, a turn of the same conversation): train's held-out pick takes samples whose key
    no other sample has first, as eval's held-out prompts are written apart from the training ones (issue 31)."""
    first = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    opening = " ".join(words(first if isinstance(first, str) else "")[:OPENING_WORDS])
    return int.from_bytes(hashlib.blake2b(opening.encode(), digest_size=8).digest(), "little", signed=True)

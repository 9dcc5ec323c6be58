"""What eval measures τ on: built-in sets, prompt files, and the public benchmark sets the anchors report.

    flashdraft eval --prompts gsm8k --prompts mt-bench=data/mt_bench.jsonl --prompts builtin:chat-heldout

A source is one of:
- a standard set's name (`gsm8k`, `math500`, `humaneval`, `mbpp`, `mt-bench`, and SPEED-Bench's `speed-bench`,
  `speed-bench-1k` … `speed-bench-32k`; flashdraft/standard_sets.yaml): the public dataset through
  `datasets.load_dataset`,
  formatted as z-lab's benchmark script formats it (SPEED-Bench: its user turns as they are);
- `NAME=PATH`: the same set from a local JSONL / Parquet file or `save_to_disk` directory in the dataset's own
  schema and field names (for machines that cannot reach the hub): the same formatting, the same code after the
  rows are read;
- anything else: a prompt file or `builtin:` set, read as `generate` reads prompts.

`eval.max_prompts` applies to each source. A standard set larger than that is cut as z-lab's benchmark cuts it
(`--max-samples N`: Python's `random.seed(0)`, then `random.shuffle`, then the first N), so the same N selects
the same prompts; other sources keep their first N. Records a set cannot format are returned with the reason.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.errors import BadInput
from flashdraft.generate.prompts import BUILTIN, Prompt, Rejected, load_prompts, read_records
from flashdraft.records import prompt_id
from flashdraft.standard_sets import split_source, standard_sets


@dataclass(frozen=True)
class EvalPrompt:
    dataset: str  # the source's name in the report: a standard set's name, or the source as given
    prompt: Prompt  # its first user turn (with any history the record carries)
    follow_ups: tuple[str, ...] = ()  # later user turns, each asked after the target's own answer


@dataclass
class EvalSet:
    name: str
    prompts: list[EvalPrompt]
    rejected: list[Rejected]


def load_eval_sets(sources: list[str], max_prompts: int) -> list[EvalSet]:
    names = [split_source(source)[0] or source for source in sources]
    if len(set(names)) < len(names):
        raise BadInput(f"a prompt set is named twice in {sources}: each set is measured once")
    out = []
    for source in sources:
        name, path = split_source(source)
        if name is None:
            if not source.startswith(BUILTIN) and not Path(source).exists():
                raise BadInput(f"prompts not found: {source} (a JSONL / Parquet file, a save_to_disk directory, "
                               f"builtin:NAME, or a standard set: {', '.join(standard_sets())}, each also as "
                               "NAME=PATH)")
            loaded = load_prompts(source)
            prompts = [EvalPrompt(source, p) for p in loaded.prompts[:max_prompts]]
            out.append(EvalSet(source, prompts, loaded.rejected))
        else:
            out.append(load_standard(name, path, max_prompts))
    return out


def load_standard(name: str, path: str | None, max_prompts: int | None = None) -> EvalSet:
    spec = standard_sets()[name]
    rows = list(_rows(name, spec, path))
    if max_prompts is not None and len(rows) > max_prompts:
        random.Random(0).shuffle(rows)  # z-lab's subset for --max-samples N (its benchmark seeds 0, then shuffles)
        rows = rows[:max_prompts]
    prompts, rejected = [], []
    for number, record in rows:
        try:
            turns = _turns(spec, record)
        except ValueError as e:
            rejected.append(Rejected(number, f"{name}: {e}", "" if isinstance(record, Exception) else str(record),
                                     unreadable=isinstance(record, Exception)))
            continue
        messages = [{"role": "user", "content": turns[0]}]
        category = record.get(spec["category"]) if "category" in spec else None
        prompt = Prompt(prompt_id([{"role": "user", "content": t} for t in turns]), messages,
                        category if isinstance(category, str) else None)
        prompts.append(EvalPrompt(name, prompt, tuple(turns[1:])))
    return EvalSet(name, prompts, rejected)


def _rows(name: str, spec: dict[str, Any], path: str | None):
    """(row number, record) in the dataset's own order, from the hub or a local copy."""
    if path is None:
        from datasets import load_dataset

        hub = spec["hub"]
        unreachable = go_offline_unless_the_hub_answers()
        try:
            rows = load_dataset(*hub, split=spec["split"])
        except Exception as e:  # offline, a wrong name, a hub outage: all the same to the user
            where = "from the hub" + (f" ({unreachable} unreachable, or offline mode on)" if unreachable else "")
            raise BadInput(f"{name}: cannot load {_hub_name(spec)} {where} "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else 'no detail'}); "
                           f"copy it where this machine can read it and pass --prompts {name}=PATH") from None
        yield from enumerate(rows, start=1)
        return
    if not path or not Path(path).exists():
        raise BadInput(f"{name}: {path or 'no path after ='} not found (a JSONL / Parquet file or save_to_disk "
                       f"directory in {spec['hub'][0]}'s own schema)")
    for number, record, _ in read_records(path):
        yield number, record  # a line that is not JSON comes as its BadRecord, rejected with the others


def go_offline_unless_the_hub_answers(timeout_s: float = 3.0) -> str | None:
    """A machine that cannot reach the hub would sit through datasets' retries (6 tries, about 25 s, a warning line
    each) before the one-line error: when the hub's host does not accept a connection within `timeout_s`, datasets
    and huggingface_hub are put in offline mode for this process instead, so a set already in the local cache still
    loads and a missing one fails at once. Returns the hub's host when it is offline now, else None."""
    import socket
    from urllib.parse import urlparse

    import datasets
    import huggingface_hub.constants

    endpoint = urlparse(huggingface_hub.constants.ENDPOINT)
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    if datasets.config.HF_HUB_OFFLINE:
        return host
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return None
    except OSError:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
        return host


def _hub_name(spec: dict[str, Any]) -> str:
    """openai/gsm8k (main, test): the dataset, its configuration and split."""
    return f"{spec['hub'][0]} ({', '.join([*spec['hub'][1:], spec['split']])})"


def _turns(spec: dict[str, Any], record: Any) -> list[str]:
    if isinstance(record, Exception):
        raise ValueError(str(record))
    if not isinstance(record, dict):
        raise ValueError(f"record is a {type(record).__name__}, not an object")
    if "turns" in spec:
        fields = spec["turns"] if isinstance(spec["turns"], list) else [spec["turns"]]
        field = next((f for f in fields if f in record), fields[0])
        turns = record.get(field)
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"`{field}` must be a non-empty list of non-empty strings")
        if spec.get("placeholder") and any(spec["placeholder"] in t for t in turns):
            raise ValueError(f"its `{field}` are the hub copy's placeholder, not the prompt (the text stays at its "
                             "source: fetch the full set with ModelOpt's specdec_bench and pass NAME=PATH)")
        return turns
    for name in template_fields(spec["turn"]):
        if name not in record:
            note = next((why for marker, why in spec.get("misread", {}).items() if marker in record), None)
            raise ValueError(f"no `{name}` field (has: {', '.join(sorted(record)) or 'none'})"
                             + (f": {note}" if note else ""))
        if not isinstance(record[name], str):  # null, a number, an object: formatted, it would be measured
            raise ValueError(f"`{name}` is {_json_type(record[name])}, not a string")
    text = spec["turn"].format_map(record)
    if not text.strip():
        raise ValueError("the formatted turn is empty")
    return [text]


def template_fields(template: str) -> list[str]:
    """The record fields a `turn` template reads (`{question}` → question)."""
    import string

    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def _json_type(value: Any) -> str:
    return {type(None): "null", dict: "an object", list: "a list", bool: "a boolean"}.get(type(value), "a number")

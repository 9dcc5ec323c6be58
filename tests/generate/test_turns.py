"""`generate.turns: all`: every assistant turn regenerated from the history as regenerated so far; tokenize
trains on each of them; a kill mid-conversation leaves nothing half-done that counts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from datasets import load_from_disk

from flashdraft.artifact.manifest import MANIFEST, verify_dir
from flashdraft.config import GenerateConfig
from flashdraft.generate.backends import HFBackend
from flashdraft.generate.prompts import Prompt

ORIGINAL = "ORIGINAL-ANSWER"


def conversation(i: int, assistant_turns: int) -> dict:
    """user, (assistant, user) × assistant_turns: the dataset's assistant words are to be replaced."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}, part 0?"}]
    for t in range(assistant_turns):
        messages += [{"role": "assistant", "content": f"{ORIGINAL} {i}.{t}"},
                     {"role": "user", "content": f"Question {i}, part {t + 1}?"}]
    return {"messages": messages}


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def records(out: Path) -> dict[str, dict]:
    rows = [json.loads(line) for f in sorted(out.glob("batch-*[0-9].jsonl")) for line in f.read_text().splitlines()]
    return {r["id"]: r for r in rows}


def one_at_a_time(backend: HFBackend, messages: list[dict]) -> tuple[list[dict], str]:
    """The reference: walk the conversation alone, asking the backend for each assistant turn in turn."""
    history = []
    for m in messages:
        if m["role"] == "assistant":
            answer = backend.complete([Prompt("ref", history, thinking=False)])[0]
            history.append({"role": "assistant", "content": answer.content})
        else:
            history.append(m)
    return history, backend.complete([Prompt("ref", history, thinking=False)])[0].content


def test_every_assistant_turn_is_the_target_s_own_and_tokenize_trains_on_each(cli, tmp_path, tiny_model_dir):
    rows = [conversation(0, 2), conversation(1, 0), conversation(2, 1)]  # 3, 1 and 2 assistant turns, one batch
    src = write(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "gen"
    args = ["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--turns", "all",
            "--max-new-tokens", "12", "--json"]
    stats = json.loads(cli(*args, check=True).stdout.strip().splitlines()[-1])
    assert stats["records"] == 3 and stats["assistant_turns"] == 6 and stats["thinking_off"] == 3

    backend = HFBackend(GenerateConfig(model=tiny_model_dir, max_new_tokens=12), log=lambda s: None)
    done = records(out)
    for row in rows:
        record = next(r for r in done.values() if r["messages"][1] == row["messages"][1])
        history, final = one_at_a_time(backend, row["messages"])
        assert [(m["role"], m["content"]) for m in record["messages"]] == [(m["role"], m["content"]) for m in history]
        assert record["content"] == final and record["turns"] == "all"
        assert ORIGINAL not in json.dumps(record)  # nothing of the dataset's assistant words is left

    dataset = tmp_path / "dataset"
    cli("tokenize", "--input", str(out), "--out", str(dataset), "--tokenizer", tiny_model_dir, "--workers", "1",
        "--min-loss-fraction", "0", check=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for sample in load_from_disk(str(dataset)):
        record = done[sample["id"]]
        supervised = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"], strict=True) if m])
        for turn in [m for m in record["messages"] if m["role"] == "assistant"] + [{"content": record["content"]}]:
            assert turn["content"].strip() and turn["content"].strip() in supervised  # every turn is trained on …
        assert "Question" not in supervised and "Be brief" not in supervised  # … and no user or system turn


KILL_ME = """
import sys
from flashdraft.cli import app
sys.argv = ["flashdraft", *sys.argv[1:]]
app()
"""


def test_a_kill_mid_conversation_leaves_no_conversation_counted_as_done(cli, tmp_path, tiny_model_dir):
    src = write(tmp_path / "chats.jsonl", [conversation(i, 2) for i in range(8)])
    args = ["--prompts", src, "--model", tiny_model_dir, "--turns", "all", "--batch-size", "1",
            "--max-new-tokens", "40"]
    whole = tmp_path / "whole"
    cli("generate", "--out", str(whole), *args, check=True)

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", KILL_ME, "generate", "--out", str(out), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list(out.glob("batch-*.jsonl"))) < 2 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # into a later conversation's rounds
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = sorted(out.glob("batch-*[0-9].jsonl"))
    assert 2 <= len(committed) < 8 and not (out / MANIFEST).exists()
    for f in committed:  # a committed batch holds whole conversations only
        for line in f.read_text().splitlines():
            assert sum(m["role"] == "assistant" for m in json.loads(line)["messages"]) == 2

    cli("generate", "--out", str(out), *args, check=True)
    assert verify_dir(out) == [] and records(out) == records(whole)  # as if never interrupted

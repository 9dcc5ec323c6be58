import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashdraft.artifact.manifest import MANIFEST, verify_dir
from flashdraft.config import GenerateConfig
from flashdraft.generate.backends import HFBackend, split_reasoning
from flashdraft.generate.prompts import Prompt, load_prompts
from flashdraft.records import BadRecord


def prompts_file(path: Path, n: int) -> str:
    path.write_text(
        "".join(json.dumps({"prompt": f"Question number {i}: what is {i} + {i}?"}) + "\n" for i in range(n))
    )
    return str(path)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("batch-*[0-9].jsonl")) for line in f.read_text().splitlines()]


def last_json(proc) -> dict:
    return json.loads(proc.stdout)


def test_hf_backend_writes_one_record_per_prompt_then_skips(cli, tmp_path, tiny_model_dir):
    src = prompts_file(tmp_path / "p.jsonl", 12)
    out = tmp_path / "gen"
    args = ["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--batch-size", "5",
            "--max-new-tokens", "8", "--json"]
    stats = last_json(cli(*args, check=True))
    assert stats["records"] == 12 and stats["errors"] == 0 and stats["rejected"] == 0 and stats["batches"] == 3
    assert verify_dir(out) == []
    rows = records(out)
    assert sorted(r["id"] for r in rows) == sorted(p.id for p in load_prompts(src).prompts)
    for r in rows:
        assert r["completion_tokens"] == len(r["token_ids"]) <= 8
        assert r["finish_reason"] in ("stop", "length") and r["prompt_tokens"] > 10
        assert r["sampling"] == {"temperature": 0.0, "max_new_tokens": 8, "thinking": False}
    assert stats["truncated"] == sum(r["finish_reason"] == "length" for r in rows)
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["kind"] == "completions"

    again = cli(*args, check=True)
    assert "already done, verified" in again.stderr

    changed = cli(*args[:-1], "--max-new-tokens", "9")  # same --out, different settings: refused, not mixed
    assert changed.returncode == 1 and "different prompts or settings" in changed.stderr


def test_greedy_hf_matches_a_bare_generate_loop(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = GenerateConfig(model=tiny_model_dir, max_new_tokens=6)
    backend = HFBackend(cfg, log=lambda s: None)
    prompts = [
        Prompt("a", [{"role": "user", "content": "Hi"}]),
        Prompt("b", [{"role": "user", "content": "A longer one"}]),
    ]
    done = backend.complete(prompts)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for prompt, completion in zip(prompts, done, strict=True):  # one at a time: no padding involved
        ids = tok.apply_chat_template(
            prompt.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            ref = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1] :].tolist()
        assert completion.token_ids == ref[: len(completion.token_ids)]


def test_dtype_sets_the_weights_the_target_generates_with(tiny_model_dir):
    import torch

    chosen = {d: HFBackend(GenerateConfig(model=tiny_model_dir, dtype=d), log=lambda s: None).model.dtype
              for d in ("auto", "bfloat16", "float32")}
    assert chosen == {"auto": torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}  # on CPU
    prompt = [Prompt("a", [{"role": "user", "content": "Hi"}])]
    low = HFBackend(GenerateConfig(model=tiny_model_dir, dtype="bfloat16", max_new_tokens=4), log=lambda s: None)
    assert len(low.complete(prompt)[0].token_ids) >= 1  # and it generates


KILL_ME = """
import sys
from flashdraft.cli import app
app(sys.argv[1:], prog_name="flashdraft")
"""


def test_sigkill_then_rerun_ends_with_exactly_one_record_per_prompt(cli, tmp_path, tiny_model_dir):
    src = prompts_file(tmp_path / "p.jsonl", 24)
    out = tmp_path / "gen"
    args = ["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--batch-size", "1",
            "--max-new-tokens", "120"]
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_ME, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while len(list(out.glob("batch-*.jsonl"))) < 3 and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = {f.name: f.stat().st_mtime_ns for f in out.glob("batch-*.jsonl")}
    assert 3 <= len(committed) < 24 and not (out / MANIFEST).exists()

    cli(*args, check=True)
    rows = records(out)
    assert len(rows) == 24 and len({r["id"] for r in rows}) == 24
    for name, mtime in committed.items():  # finished batches were not generated again
        assert (out / name).stat().st_mtime_ns == mtime
    assert verify_dir(out) == []


def test_failed_requests_are_not_done_and_a_rerun_retries_them(cli, tmp_path):
    """The endpoint is down: every request fails. That is not "done": exit 1, no manifest, the failures in
    errors.jsonl; a rerun retries them; only an explicit tolerance lets an artifact with errors count as done."""
    from tests.servers import failing_endpoint

    with failing_endpoint("m", "drop") as url:  # lists its model, then drops every request unanswered
        config = tmp_path / "c.yaml"
        config.write_text("generate:\n  max_retries: 0\n  timeout_s: 5\n")
        src = prompts_file(tmp_path / "p.jsonl", 3)
        out = tmp_path / "gen"
        args = ["generate", "--config", str(config), "--prompts", src, "--out", str(out), "--backend", "openai",
                "--model", "m", "--base-url", url]
        proc = cli(*args)
        assert proc.returncode == 1 and "3 of 3 requests failed" in proc.stderr and "Traceback" not in proc.stderr
        assert "done, verified" not in proc.stdout + proc.stderr and not (out / MANIFEST).exists()
        errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
        assert len(errors) == 3 and all("Connection" in e["reason"] for e in errors)

        again = cli(*args)  # still down: the three are retried (not skipped as committed), and fail again
        assert again.returncode == 1 and "1 with failed requests to retry" in again.stdout
        assert len((out / "errors.jsonl").read_text().splitlines()) == 3

        config.write_text("generate:\n  max_retries: 0\n  timeout_s: 5\n  max_error_fraction: 1.0\n")
        stats = last_json(cli(*args, "--json", check=True))  # a stated tolerance: done, with the errors counted
    assert stats["records"] == 0 and stats["errors"] == 3 and verify_dir(out) == []


def test_shards_split_the_work_without_overlap(cli, tmp_path, tiny_model_dir):
    src = prompts_file(tmp_path / "p.jsonl", 10)
    ids = []
    for shard in range(2):
        out = tmp_path / f"gen-{shard}"
        cli("generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--max-new-tokens", "2",
            "--shard-index", str(shard), "--num-shards", "2", check=True)
        ids.append({r["id"] for r in records(out)})
    assert not ids[0] & ids[1]
    assert ids[0] | ids[1] == {p.id for p in load_prompts(src).prompts}


def test_upload_to_pushes_batches_and_verifies(cli, tmp_path, tiny_model_dir):
    src = prompts_file(tmp_path / "p.jsonl", 4)
    store = tmp_path / "store"
    cli("generate", "--prompts", src, "--out", str(tmp_path / "gen"), "--model", tiny_model_dir, "--batch-size",
        "2", "--max-new-tokens", "2", "--upload-to", str(store), check=True)
    assert verify_dir(store) == []
    assert (store / MANIFEST).read_bytes() == (tmp_path / "gen" / MANIFEST).read_bytes()


def test_corrupted_batch_is_regenerated_on_rerun(cli, tmp_path, tiny_model_dir):
    src = prompts_file(tmp_path / "p.jsonl", 4)
    out = tmp_path / "gen"
    args = ["generate", "--prompts", src, "--out", str(out), "--model", tiny_model_dir, "--batch-size", "2",
            "--max-new-tokens", "3"]
    cli(*args, check=True)
    good = (out / "batch-000001.jsonl").read_text()
    (out / "batch-000001.jsonl").write_text(good[:-10])
    rerun = cli(*args, check=True)
    assert "does not verify" in rerun.stdout
    assert (out / "batch-000001.jsonl").read_text() == good and verify_dir(out) == []


QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_thinking_flag_reaches_the_chat_template(tmp_path, tiny_model_dir):
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "qwen-ish"
    shutil.copytree(tiny_model_dir, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    tok.save_pretrained(model_dir)
    backend = HFBackend(GenerateConfig(model=str(model_dir)), log=lambda s: None)
    off = backend.render(Prompt("x", [{"role": "user", "content": "Hi"}], thinking=False))
    on = backend.render(Prompt("x", [{"role": "user", "content": "Hi"}], thinking=True))  # each prompt its own mode
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_mixed_thinking_is_drawn_by_id_and_a_record_s_own_mode_wins():
    from flashdraft.generate.prompts import normalize, thinking_for

    prompts = [normalize({"prompt": f"question {i}"}) for i in range(400)]
    modes = [thinking_for(p, "mixed", 0.25) for p in prompts]
    assert modes == [thinking_for(p, "mixed", 0.25) for p in prompts]  # same draw on every machine and rerun
    assert 0.18 < sum(modes) / len(modes) < 0.32
    assert not any(thinking_for(p, "mixed", 0.0) for p in prompts)
    assert all(thinking_for(p, "mixed", 1.0) for p in prompts)
    own = normalize({"prompt": "question 0", "thinking": True})
    assert thinking_for(own, False, 0.5) is True and thinking_for(own, "mixed", 0.0) is True
    with pytest.raises(BadRecord, match="`thinking` must be true or false"):
        normalize({"prompt": "q", "thinking": "yes"})


def test_reasoning_is_kept_apart_and_stray_markers_counted():
    assert split_reasoning("<think>\nstep 1\n</think>\n\nThe answer is 4.") == ("step 1", "The answer is 4.", 0)
    assert split_reasoning("step 1</think>Answer") == ("step 1", "Answer", 0)  # template opened the block
    assert split_reasoning("plain answer") == (None, "plain answer", 0)
    assert split_reasoning("Answer <think> oops") == (None, "Answer <think> oops", 1)
    assert split_reasoning("Answer", reasoning="server-side") == ("server-side", "Answer", 0)
    assert split_reasoning("<think>a</think>b</think>c")[2] == 1


# ------------------------------------------------------------------------------------------- slow: real servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_openai_backend_against_transformers_serve(cli, tmp_path, tiny_model_dir):
    from tests.servers import transformers_serve

    with transformers_serve(tiny_model_dir, tmp_path / "serve.log") as url:
        port = int(url.rsplit(":", 1)[1])
        src = prompts_file(tmp_path / "p.jsonl", 6)
        out = tmp_path / "gen"
        args = ["generate", "--prompts", src, "--out", str(out), "--backend", "openai", "--max-new-tokens", "8",
                "--batch-size", "3", "--model", tiny_model_dir]  # named: a server that is down cannot say
        # First against an endpoint that is down: preflight finds it in seconds and nothing is written; then one
        # that serves another model.
        dead = f"http://127.0.0.1:{_free_port()}/v1"
        down = cli(*args, "--base-url", dead)
        assert down.returncode == 1 and f"endpoint {dead}: does not answer" in down.stderr and not out.exists()
        wrong = cli(*[a if a != tiny_model_dir else "no-such-model" for a in args], "--base-url", f"{url}/v1")
        assert wrong.returncode == 1 and "does not serve 'no-such-model'" in wrong.stderr and not out.exists()
        proc = cli(*args, "--base-url", f"http://127.0.0.1:{port}/v1", "--json", check=True)
        stats = last_json(proc)
        assert stats["records"] == 6 and stats["errors"] == 0 and verify_dir(out) == []
        rows = records(out)
        assert all(0 < r["completion_tokens"] <= 8 and r["prompt_tokens"] > 0 for r in rows)
        assert all(r["model"] for r in rows)

        # An agent trace with tools, every assistant turn regenerated, modes mixed: the server takes the tools
        # and the tool turns, and each record says what it was generated with.
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        trace = {"tools": tools, "messages": [
            {"role": "user", "content": "Find it."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "id": "c1", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "found"},
            {"role": "user", "content": "Summarize."}]}
        agent = tmp_path / "agent.jsonl"
        agent.write_text(json.dumps(trace) + "\n" + '{"prompt": "Hello?"}\n')
        stats = last_json(cli("generate", "--prompts", str(agent), "--out", str(tmp_path / "agent"), "--backend",
                              "openai", "--max-new-tokens", "8", "--model", tiny_model_dir, "--turns", "all",
                              "--thinking", "mixed", "--base-url", f"http://127.0.0.1:{port}/v1", "--json",
                              check=True))
        assert stats["records"] == 2 and stats["assistant_turns"] == 3
        assert stats["thinking_on"] + stats["thinking_off"] == 2
        done = {r["messages"][0]["content"]: r for r in records(tmp_path / "agent")}
        assert done["Find it."]["tools"] == tools and done["Find it."]["messages"][2]["role"] == "tool"
        assert done["Find it."]["messages"][1]["content"] != ""  # the target's own turn replaced the tool call


@pytest.mark.slow
def test_hf_backend_on_smollm2(cli, tmp_path, smollm2_dir):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "What is 2 + 2?"}\n{"prompt": "Name a primary color."}\n')
    out = tmp_path / "gen"
    stats = last_json(cli("generate", "--prompts", str(src), "--out", str(out), "--max-new-tokens", "24", "--json",
                          check=True))
    assert stats["records"] == 2
    rows = {r["messages"][0]["content"]: r for r in records(out)}
    assert "4" in rows["What is 2 + 2?"]["content"]
    assert rows["What is 2 + 2?"]["finish_reason"] == "stop" and rows["What is 2 + 2?"]["token_ids"][-1] == 2


def test_vllm_backend_without_vllm_is_a_clear_error(cli, tmp_path):
    pytest.importorskip("torch")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    src = prompts_file(tmp_path / "p.jsonl", 2)
    proc = cli("generate", "--prompts", src, "--out", str(tmp_path / "gen"), "--backend", "vllm")
    assert proc.returncode == 1 and "needs vllm" in proc.stderr and "Traceback" not in proc.stderr


def test_in_a_log_file_progress_is_plain_lines_and_library_bars_are_silent(cli, tmp_path, tiny_model_dir):
    """stdout/stderr are files here, as under nohup or a scheduler: no rich bars, no "Loading weights" bars,
    but a plain progress line at the set interval."""
    import os

    src = prompts_file(tmp_path / "p.jsonl", 4)
    env = {**os.environ, "FLASHDRAFT_PROGRESS_SECONDS": "0"}
    proc = cli("generate", "--prompts", src, "--out", str(tmp_path / "gen"), "--model", tiny_model_dir,
               "--batch-size", "2", "--max-new-tokens", "2", env=env, check=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("generate") and "/4 (" in line]
    assert [line.split("/4 (")[0].rsplit(" ", 1)[1] for line in lines] == ["2", "4"] and "ETA" in lines[0]
    assert "Loading weights" not in proc.stderr and "\r" not in proc.stderr

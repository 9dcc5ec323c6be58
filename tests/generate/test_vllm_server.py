"""generate's `openai` backend against a real vLLM server (its CPU build) serving the embedded target, as the
reference case runs it against vLLM/SGLang hosts: preflight, committed batches, kill -9 and resume, a request
the server refuses counted (not lost), then tokenize. Needs `scripts/engines.sh` (CI runs it); else it skips."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flashdraft.artifact.manifest import MANIFEST, verify_dir
from flashdraft.evaluate.engine_commands import engine_program
from flashdraft.served import SERVED_NAME
from tests.generate.test_generate import records
from tests.servers import vllm_serve

VLLM = engine_program("vllm", None)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM.is_file(), reason=f"vLLM's CPU build is not installed at {VLLM}: run scripts/engines.sh")
def test_generate_through_vllm_resumes_after_kill_and_counts_a_refused_request(cli, tmp_path, smollm2_dir):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"In one sentence, what is {i} + {i}?"} for i in range(10)]
    rows.append({"prompt": "Repeat after me: " + "the river runs to the sea, " * 120})  # past the server's context
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.yaml"
    config.write_text("generate:\n  max_retries: 0\n  max_error_fraction: 0.2\n")
    out = tmp_path / "gen"
    with vllm_serve(VLLM, smollm2_dir, tmp_path / "vllm.log", 512) as base:
        args = ["generate", "--config", str(config), "--prompts", str(prompts), "--out", str(out), "--backend",
                "openai", "--base-url", f"{base}/v1", "--model", SERVED_NAME, "--max-new-tokens", "16",
                "--batch-size", "2"]
        first = subprocess.Popen([sys.executable, "-m", "flashdraft", *args], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        deadline = time.time() + 180
        while len(list(out.glob("batch-*[0-9].jsonl"))) < 2 and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        committed = {f.name: f.stat().st_mtime_ns for f in out.glob("batch-*[0-9].jsonl")}
        assert 2 <= len(committed) < 6 and not (out / MANIFEST).exists()

        stats = json.loads(cli(*args, "--json", check=True).stdout)
    assert stats["records"] == 10 and stats["errors"] == 1 and verify_dir(out) == []
    assert all((out / name).stat().st_mtime_ns == mtime for name, mtime in committed.items())  # not redone
    refused = json.loads((out / "errors.jsonl").read_text())
    assert refused["messages"][0]["content"].startswith("Repeat after me") and refused["reason"]
    assert all(0 < r["completion_tokens"] <= 16 and r["model"] == SERVED_NAME for r in records(out))

    dataset = tmp_path / "dataset"
    # answers capped at 16 tokens after SmolLM2's system prompt: the gate's default 30 % supervised would refuse them
    cli("tokenize", "--input", str(out), "--out", str(dataset), "--tokenizer", smollm2_dir, "--block-size", "4",
        "--min-loss-fraction", "0.1", check=True)
    assert verify_dir(dataset) == []

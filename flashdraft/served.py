"""Engines flashdraft starts and talks to (vLLM, llama-server): neighbours, not parts of flashdraft. Used by eval
(`--engine`, evaluate/engines.py) and by train (`feature_source: engine`, train/engine_features.py).

    with served(lambda socket: [...engine command listening on socket...], log_path, print) as endpoint:
        ask(endpoint, "/v1/completions", {...})

- **It is flashdraft's own process, and dies with it.** It starts under a guard (guard.py) that leads its own process
  group: SIGTERM to flashdraft unwinds through `served`'s cleanup, SIGKILL to flashdraft reaches the guard through
  the kernel (PR_SET_PDEATHSIG), and the guard stops the engine's whole group either way.
- **What answers is the engine.** It serves on a Unix socket in a directory flashdraft creates with mode 0700 for
  the run, and flashdraft talks to it only after the kernel says who listens there (SO_PEERCRED): a process of this
  user in the engine's own group. No port is chosen, so none can be taken by a neighbour while the engine loads.
- **What it says is untrusted input**: every answer within a deadline (a wall clock over the whole exchange) and a
  size; the callers parse it against a schema.
"""

from __future__ import annotations

import http.client
import json
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
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import flashdraft.guard
from flashdraft.errors import ExpectedFailure
from flashdraft.guard import GRACE_S
from flashdraft.layout import engines_dir

# sitecustomize.py there: the runtime fixes vLLM's CPU build needs (flashdraft/vllm_cpu), put on the PYTHONPATH of
# every vLLM process flashdraft starts; on a machine with a GPU they change nothing
VLLM_CPU_FIXES = Path(__file__).parent / "vllm_cpu"


def vllm_cpu_fixes_env() -> dict[str, str]:
    """The environment that loads the CPU build's fixes ahead of anything already on PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(VLLM_CPU_FIXES), os.environ.get("PYTHONPATH")]))}

START_TIMEOUT_S = 600  # vLLM's CPU build loads and warms up in about a minute on 2 cores; compiling takes longer
SERVED_NAME = "target"  # the name flashdraft serves the target under
MAX_ANSWER_BYTES = 16 << 20  # a completion of a few thousand tokens, or a /metrics page, is far smaller
GUARD = flashdraft.guard.__file__  # run by path: the guard imports nothing of flashdraft's
INSTALLED_MARKER = ".flashdraft-installed"  # scripts/engines.sh writes it last: an interrupted install has none


class EngineFailed(ExpectedFailure):
    """The engine did not start, did not load the drafter, or did not answer: its log says why."""


def check_installed(engine: str, program: Path, chosen: bool) -> None:
    """The engine flashdraft would start is there, and (unless the user named its program) completely installed."""
    if not program.is_file():
        raise EngineFailed(f"no {engine} at {program}: run scripts/engines.sh (or pass --engine-url for a server "
                           "already running)")
    if not chosen and not (engines_dir(engine) / INSTALLED_MARKER).is_file():
        raise EngineFailed(f"{engine} at {engines_dir(engine)} is not completely installed (no {INSTALLED_MARKER}, "
                           "which scripts/engines.sh writes last): run scripts/engines.sh again")


# ---------------------------------------------------------------------------------------------- talking to it


@dataclass(frozen=True)
class Endpoint:
    """Where an engine answers: the private Unix socket of one flashdraft started (answered only by a process of
    `group`, the engine's process group), or the URL of a server the user named (`--engine-url`)."""

    url: str | None = None
    socket_path: Path | None = None
    group: int | None = None
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token on every request; never shown

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
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
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


@contextmanager
def served(command_at: Callable[[Path], list[str]], log_path: Path, log: Callable[[str], None],
           shown_log: Path | None = None, timeout_s: float = START_TIMEOUT_S,
           env: dict[str, str] | None = None) -> Iterator[Endpoint]:
    """Start the engine under the guard, on a Unix socket in a fresh 0700 directory, wait until `/health` answers
    from a process of the engine's own group, yield that endpoint, and stop the guard's whole group afterwards —
    after an exception or a stop signal as after success. `shown_log` is where an error says the log will be."""
    shown_log = shown_log or log_path
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {}))
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
        log(f"engine serving at {endpoint} after {time.monotonic() - started:.0f} s (log: {shown_log})")
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

"""Target features from a serving engine: vLLM computes the target's hidden states, the trainer reads them.

    train:
      feature_source: engine     # online or offline features alike; the loop does not know which source it reads

Where users outgrow a per-process transformers copy of the target (a 400B MoE; a hybrid whose Gated-DeltaNet layers
transformers runs on its slow reference loop), the engine brings its own kernels and parallelism. flashdraft starts
vLLM itself (served.py: its own process under a guard, on a private Unix socket, stopped with the run) with vLLM's
hidden-state extraction: speculative method `extract_hidden_states` with the layers as
`eagle_aux_hidden_state_layer_ids`, and the `ExampleHiddenStatesConnector` writing each request's states into a
directory flashdraft made for the run (mode 0700). One request per sequence — its token ids as the prompt, one
token generated — answers with `kv_transfer_params.hidden_states_path`: a safetensors file of `hidden_states`
[T, n, H] and `token_ids`, read once (after the writer's lock is released), checked, and deleted: nothing grows
on disk. The file is untrusted input like the answer: it must be named after the request (whose id flashdraft
chose), a regular file reached without a link, no larger than the states it can hold, its lock released before the
request's deadline; a failure is one line naming the server, and a file that failed is never deleted.

Numbering: flashdraft's target layer i is decoder layer i's output (transformers' `hidden_states[i + 1]`); vLLM's
id L is `hidden_states[L]`, and its id equal to the layer count is the last layer's output before the final norm —
which is what flashdraft's hook on that layer reads too. So flashdraft asks for i + 1.

The layers asked for are the drafter's and the target's last (model/target.py `source_layers`): the trainer
holds the target's embedding, final norm and LM head only, and makes the target's next-token distribution from the
last layer's states (labels: target, distillation, DSpark's target terms, the held-out walk).

On a CPU vLLM's connector needs two runtime fixes outside vLLM's code (flashdraft/vllm_cpu/sitecustomize.py).
On GPUs the engine runs on the target's devices (`train.target_device`, as CUDA_VISIBLE_DEVICES, tensor-parallel
over them): written, not yet run on a GPU.

**A target fleet** (`train.engine_urls`): vLLM servers already running on other hosts, checked, proven by content
and keyed in train/fleet.py; their answers are read here as a server flashdraft started is.

**Every answer is judged by what it computed**: it carries the token the server chose after the sequence; the
trainer holds the target's final norm and LM head, runs them over the last layer's state the server returned, and
refuses an answer whose token is not among its own top 5 — a cheap check on every answer, not the proof (a model
sharing the target's head passes it; the fleet's proof compares every layer).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from flashdraft.config import TrainConfig
from flashdraft.layout import engines_dir
from flashdraft.served import (
    SERVED_NAME,
    Endpoint,
    EngineFailed,
    ask,
    check_installed,
    served,
    vllm_cpu_fixes_env,
)

# The trainer's own most likely next tokens after a sequence, from the engine's states for it (T × n × H)
Judge = Callable[[torch.Tensor], list[int]]
PROBE = [1, 2, 3, 5, 8, 13, 21, 34]  # a fixed sequence each fleet server answers before any work
ANSWER_DEADLINE_S = 600  # one sequence's prefill on a 2-core CPU; seconds on a GPU


def engine_python(cfg: TrainConfig) -> Path:
    return Path(cfg.engine_python) if cfg.engine_python else engines_dir("vllm") / "bin" / "python"


# vllm-project/vllm#46301 (in 0.26.0): before it, `extract_hidden_states` returned all-zero states for hybrid
# (Gated-DeltaNet, Mamba) targets such as Qwen3.6 — training converges, and the drafter accepts almost nothing
VLLM_FLOOR = (0, 26, 0)
VLLM_BUILD = """import importlib.metadata as m
for name in ("vllm", "vllm-cpu"):
    try:
        print(name, m.version(name))
        break
    except m.PackageNotFoundError:
        pass
"""


def version_tuple(version: str) -> tuple[int, ...]:
    """A version's release numbers (0.32.0+cpu → (0, 32, 0)); () for one that is not a version."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return ()


def check_version(where: str, version: str) -> None:
    if version_tuple(version) < VLLM_FLOOR:
        raise EngineFailed(f"{where} is vLLM {version}: before {'.'.join(map(str, VLLM_FLOOR))} "
                           "(vllm-project/vllm#46301) its extraction returns all-zero states for hybrid targets such "
                           "as Qwen3.6; install a newer vLLM")


def check_engine_features(cfg: TrainConfig, target_device: str | None = None) -> str:
    """Before any work: the vLLM train would start is installed, is a build for the devices the target runs on (the
    CPU build that scripts/engines.sh installs for the tests cannot serve on a GPU), and is no older than the floor.
    `target_device`: where the target runs (default: train.target_device, else cuda where there is one)."""
    import subprocess

    program = engine_python(cfg)
    check_installed("vllm", program, chosen=cfg.engine_python is not None)
    try:
        found = subprocess.run([str(program), "-c", VLLM_BUILD], capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL).stdout.split()
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineFailed(f"{program}: cannot ask it which vLLM it has ({e})") from None
    if len(found) != 2:
        raise EngineFailed(f"{program}: no vLLM installed there (neither vllm nor vllm-cpu): point "
                           "train.engine_python at a virtualenv with vLLM, or run scripts/engines.sh for the CPU build")
    build, version = found
    device = target_device or cfg.target_device or ("cuda" if torch.cuda.is_available() else "cpu")
    if build == "vllm-cpu" and "cuda" in device:
        raise EngineFailed(f"{program} has vLLM's CPU build ({build} {version}), which cannot serve the target on "
                           f"{device} (train.target_device): install vLLM for GPUs in a virtualenv of its own "
                           "(python -m venv /opt/vllm && /opt/vllm/bin/pip install 'vllm>=0.26') and set "
                           "train.engine_python: /opt/vllm/bin/python")
    check_version(str(program), version)
    return f"vllm: {program} ({build} {version}, for {'GPUs' if 'cuda' in device else 'the CPU'})"


def extraction_command(python: Path | str, target_dir: str, layer_ids: list[int], where: Path | int,
                       storage: Path, max_model_len: int, dtype: str, devices: list[str], name: str = SERVED_NAME,
                       host: str = "127.0.0.1") -> list[str]:
    """vLLM's OpenAI server for the target with hidden-state extraction at flashdraft's `layer_ids` (vLLM's ids
    i + 1), writing each request's states under `storage`; prefix caching off, so every position is computed.
    `where` is the private socket of one flashdraft starts, or a fleet server's port."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in layer_ids]}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    listen = ["--uds", str(where)] if isinstance(where, Path) else ["--host", host, "--port", str(where)]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir, "--served-model-name",
               name, *listen, "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--no-enable-prefix-caching", "--seed", "0", "--speculative-config", json.dumps(spec),
               "--kv-transfer-config", json.dumps(transfer)]
    if devices:
        command += ["--tensor-parallel-size", str(len(devices))]
    else:
        command += ["--enforce-eager"]  # a CPU: no minutes of compiling
    return command


class EngineFeatures:
    """The target's features at the watched layers for token ids, from the engine: what `Target.forward` returns as
    its features when the target's source is the engine (model/target.py `use`)."""

    def __init__(self, endpoints: list[Endpoint], storage: Path, layer_ids: list[int], hidden_size: int,
                 log_path: str, name: str = SERVED_NAME, first: int = 0, judge: Judge | None = None,
                 log: Callable[[str], None] | None = None, run: str = "") -> None:
        self.endpoints, self.storage, self.log_path = list(endpoints), storage.resolve(), log_path
        self.layer_ids, self.hidden_size, self.name, self.first = list(layer_ids), hidden_size, name, first
        self.judge, self.log = judge, log or (lambda line: None)
        # every request this process makes is named so: its files in a shared directory are told from every other
        # trainer's (other runs, machines, ranks), and this rank of this run, started again, removes what it left.
        # `run` is the run's output directory, which one process at a time holds locked on this machine.
        tag = hashlib.sha256(f"{socket.gethostname()}:{run}".encode()).hexdigest()[:12]
        self.prefix = f"flashdraft-{tag}-r{first}-"
        self.reported: dict[str, str] = {}  # a fleet's servers: the model each says it loaded (its path there)
        self.pool = ThreadPoolExecutor(max_workers=4 * len(self.endpoints), thread_name_prefix="engine-features")

    def features(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """B × T × n·H float32: each row's states, its requests in flight together (the engines batch them), rows
        round-robin over the servers (each training process starting at its own: `first`)."""
        rows = [row.tolist() for row in input_ids_BT.cpu()]
        try:
            return torch.stack(list(self.pool.map(self.one_of_the_fleet, rows, range(self.first, self.first +
                                                                                         len(rows)))))
        except EngineFailed as e:  # the engine's own words are in its log: name it
            raise EngineFailed(f"target features from vLLM: {e} (log: {self.log_path})") from None

    def one_of_the_fleet(self, ids: list[int], turn: int) -> torch.Tensor:
        """A sequence's states from the server whose turn it is, or — where that server does not answer (down,
        restarting, timed out) — from the next one that does. An answer that is wrong (another model, zeros, other
        tokens, a file out of bounds) is not retried: it ends the run, as a server that lies would on retry too."""
        tried = []
        for k in range(len(self.endpoints)):
            endpoint = self.endpoints[(turn + k) % len(self.endpoints)]
            try:
                return self.one(ids, endpoint)
            except ServerUnreachable as e:
                tried.append(str(e))
                if k + 1 < len(self.endpoints):
                    self.log(f"train: {e}; the sequence goes to {self.endpoints[(turn + k + 1) % len(self.endpoints)]}")
        raise EngineFailed(f"no server of the fleet answered: {'; '.join(tried)}")

    def one(self, ids: list[int], endpoint: Endpoint, judged: bool = True) -> torch.Tensor:
        # the request's id is ours: vLLM names the file after it, so the answer can name only a file of this request
        request, deadline = f"{self.prefix}{uuid.uuid4().hex}", time.monotonic() + ANSWER_DEADLINE_S
        try:
            answer = ask(endpoint, "/v1/completions", {"model": self.name, "prompt": ids, "max_tokens": 1,
                                                       "temperature": 0.0, "return_token_ids": True,
                                                       "request_id": request}, deadline_s=ANSWER_DEADLINE_S)
        except EngineFailed as e:  # it did not answer: another server may (one_of_the_fleet)
            raise ServerUnreachable(str(e)) from None
        try:
            parsed = json.loads(answer)
            path = parsed["kv_transfer_params"]["hidden_states_path"]
        except (ValueError, KeyError, TypeError):
            raise EngineFailed(f"{endpoint}: its answer names no hidden-states file (is it extracting?)") from None
        try:  # the server's own greedy next token: what its model computed, whatever name it reports
            chosen = int(parsed["choices"][0]["token_ids"][0])
        except (KeyError, TypeError, ValueError, IndexError):
            raise EngineFailed(f"{endpoint}: its answer does not say which token it chose (token_ids)") from None
        path = Path(str(path))
        states = self.read(path, endpoint, request, expected_bytes(len(ids), len(self.layer_ids), self.hidden_size),
                           deadline)
        expected = (len(ids), len(self.layer_ids), self.hidden_size)
        hidden, token_ids = states.get("hidden_states"), states.get("token_ids")
        if hidden is None or tuple(hidden.shape) != expected or token_ids is None or token_ids.tolist() != ids:
            shape = None if hidden is None else tuple(hidden.shape)
            raise EngineFailed(f"{endpoint}: hidden states of shape {shape} for other tokens than asked (expected "
                               f"{expected} for the {len(ids)} sent)")
        if not bool(torch.isfinite(hidden).all()):
            raise EngineFailed(f"{endpoint}: hidden states that are not finite")
        if not bool(hidden.any()):  # what vLLM's extraction gave for hybrid targets before the fix
            raise EngineFailed(f"{endpoint}: hidden states that are all zero (vLLM before vllm-project/vllm#46301, "
                               "merged 2026-06-21, returns zeros for hybrid Gated-DeltaNet/Mamba targets: serve the "
                               "target with a vLLM that has it)")
        if judged and self.judge is not None and chosen not in (ours := self.judge(hidden)):
            raise EngineFailed(
                f"{endpoint} computes another model than this run's target: after the {len(ids)} tokens sent it chose "
                f"token {chosen}, which the target's own final norm and LM head over the states it returned do not "
                f"rank in their top {len(ours)} ({ours}); serve the target itself (the same weights) there")
        for done in (path, path.with_name(path.name + ".lock")):  # read and checked: this request's, so ours to delete
            done.unlink(missing_ok=True)
        return hidden.float().reshape(len(ids), -1)

    def read(self, path: Path, endpoint: Endpoint, request: str, most_bytes: int,
             deadline: float) -> dict[str, torch.Tensor]:
        """The file the engine wrote for `request`, read as untrusted input: only inside our storage directory and
        named after the request, opened as a regular file and never through a link (nor blocking on a FIFO), its
        size checked against `most_bytes` before a byte is read, once the writer's lock is released (a non-blocking
        lock, tried again until the request's deadline). Any failure is one line naming the server; the file is
        left where it is (it is deleted by `one` only once read and checked)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        if path.parent.resolve() != self.storage or path.name.startswith(".") or request not in path.name:
            raise EngineFailed(f"{endpoint}: hidden states at {path}, not this request's file in {self.storage}: "
                               "not read (a fleet server writes into train.engine_storage, mounted at the same path "
                               "on both)")
        lock = path.with_name(path.name + ".lock")
        try:
            with open_regular(lock) as held:
                while True:  # vLLM's writer holds an exclusive lock until the file is whole
                    try:
                        fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise EngineFailed(f"{endpoint}: {lock} stayed locked past the request's "
                                               f"{ANSWER_DEADLINE_S} s: not read") from None
                        time.sleep(0.05)
            with open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                if size > most_bytes:
                    raise EngineFailed(f"{endpoint}: {path} holds {size:,} bytes, more than the {most_bytes:,} its "
                                       "states can take: not read")
                data = f.read(most_bytes + 1)
        except OSError as e:
            raise EngineFailed(f"{endpoint}: its hidden states at {path} cannot be read: {e}") from None
        try:
            return load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise EngineFailed(f"{endpoint}: {path} is not a safetensors file ({e})") from None


class ServerUnreachable(EngineFailed):
    """A fleet server that gave no answer (refused, timed out, an HTTP error): the request can go to another."""


def clear_leftovers(storage: Path, prefix: str) -> int:
    """Files a killed process of this run, machine and rank left in the shared directory (its requests' states and
    their locks, named with `prefix`): removed when the same rank of the same run starts again, as nothing else
    writes those names. vLLM names a file `cmpl-<request id>-…`: only such names, regular files, never through a
    link, never below the directory; returns how many."""
    removed = 0
    for entry in os.scandir(storage):
        if entry.name.startswith(f"cmpl-{prefix}") and entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    return removed


def expected_bytes(tokens: int, layers: int, hidden: int) -> int:
    """The most a file of one sequence's states may hold: float32 states, int64 token ids and a header."""
    return tokens * layers * hidden * 4 + tokens * 8 + 64 * 1024


@contextmanager
def open_regular(path: Path):
    """`path` opened for reading as a regular file: never through a link, never waiting on a FIFO or device."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        yield f


@contextmanager
def engine_features(cfg: TrainConfig, target_dir: str, layer_ids: list[int], hidden_size: int, devices: list[str],
                    log_path: Path, log: Callable[[str], None], rank: int = 0,
                    judge: Judge | None = None) -> Iterator[EngineFeatures]:
    """vLLM serving the target's hidden states for the run: a server of its own, stopped (and its files removed)
    when the block ends (a fleet's: train/fleet.py `fleet_features`). `judge`: the trainer's own top next
    tokens from a sequence's states, held against every answer's chosen token (`EngineFeatures.one`)."""
    dtype = cfg.target_dtype if cfg.target_dtype != "auto" else ("bfloat16" if devices else "float32")
    storage = Path(tempfile.mkdtemp(prefix="flashdraft-hidden-states-"))  # 0700: ours alone
    env = vllm_cpu_fixes_env()
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.split(":")[1] for d in devices)
    try:
        log(f"train: target features from vLLM ({engine_python(cfg)}), layers {[i + 1 for i in layer_ids]} in "
            f"its numbering, {dtype}; log: {log_path}")
        def command(where: Path) -> list[str]:
            return extraction_command(engine_python(cfg), target_dir, layer_ids, where, storage, cfg.max_length + 16,
                                      dtype, devices)

        with served(command, log_path, log, env=env) as endpoint:
            source = EngineFeatures([endpoint], storage, layer_ids, hidden_size, str(log_path), judge=judge)
            try:
                yield source
            finally:
                source.pool.shutdown(wait=True)
    finally:
        shutil.rmtree(storage, ignore_errors=True)

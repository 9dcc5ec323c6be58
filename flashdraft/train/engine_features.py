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
on disk.

Numbering: flashdraft's target layer i is decoder layer i's output (transformers' `hidden_states[i + 1]`); vLLM's
id L is `hidden_states[L]`, and its id equal to the layer count is the last layer's output before the final norm —
which is what flashdraft's hook on that layer reads too. So flashdraft asks for i + 1.

On a CPU vLLM's connector needs two runtime fixes outside vLLM's code (flashdraft/vllm_cpu/sitecustomize.py).
On GPUs the engine runs on the target's devices (`train.target_device`, as CUDA_VISIBLE_DEVICES, tensor-parallel
over them): written, not yet run on a GPU. Servers already running elsewhere (a target fleet) are not used yet: their
files would have to reach this machine through a shared directory or a transfer vLLM supports.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from flashdraft.config import TrainConfig
from flashdraft.layout import engines_dir
from flashdraft.served import SERVED_NAME, Endpoint, EngineFailed, ask, check_installed, served

FIXES = Path(__file__).parents[1] / "vllm_cpu"  # sitecustomize.py: the CPU build's two runtime fixes
ANSWER_DEADLINE_S = 600  # one sequence's prefill on a 2-core CPU; seconds on a GPU


def engine_python(cfg: TrainConfig) -> Path:
    return Path(cfg.engine_python) if cfg.engine_python else engines_dir("vllm") / "bin" / "python"


def check_engine_features(cfg: TrainConfig) -> str:
    """Before any work: the vLLM that would serve the target's hidden states is installed."""
    program = engine_python(cfg)
    check_installed("vllm", program, chosen=cfg.engine_python is not None)
    return f"vllm: {program}"


def extraction_command(python: Path, target_dir: str, layer_ids: list[int], where: Path, storage: Path,
                       max_model_len: int, dtype: str, devices: list[str]) -> list[str]:
    """vLLM's OpenAI server for the target with hidden-state extraction at flashdraft's `layer_ids` (vLLM's ids
    i + 1), writing each request's states under `storage`; prefix caching off, so every position is computed."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in layer_ids]}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir, "--served-model-name",
               SERVED_NAME, "--uds", str(where), "--dtype", dtype, "--max-model-len", str(max_model_len),
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

    def __init__(self, endpoint: Endpoint, storage: Path, layer_ids: list[int], hidden_size: int,
                 log_path: Path) -> None:
        self.endpoint, self.storage, self.log_path = endpoint, storage.resolve(), log_path
        self.layer_ids, self.hidden_size = list(layer_ids), hidden_size
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-features")

    def features(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """B × T × n·H float32: each row's states, its requests in flight together (the engine batches them)."""
        rows = [row.tolist() for row in input_ids_BT.cpu()]
        try:
            return torch.stack(list(self.pool.map(self.one, rows)))
        except EngineFailed as e:  # the engine's own words are in its log: name it
            raise EngineFailed(f"target features from vLLM: {e} (log: {self.log_path})") from None

    def one(self, ids: list[int]) -> torch.Tensor:
        answer = ask(self.endpoint, "/v1/completions", {"model": SERVED_NAME, "prompt": ids, "max_tokens": 1,
                                                        "temperature": 0.0}, deadline_s=ANSWER_DEADLINE_S)
        try:
            path = json.loads(answer)["kv_transfer_params"]["hidden_states_path"]
        except (ValueError, KeyError, TypeError):
            raise EngineFailed(f"{self.endpoint}: its answer names no hidden-states file (is it extracting?)") from None
        states = self.read(Path(str(path)))
        expected = (len(ids), len(self.layer_ids), self.hidden_size)
        hidden, token_ids = states.get("hidden_states"), states.get("token_ids")
        if hidden is None or tuple(hidden.shape) != expected or token_ids is None or token_ids.tolist() != ids:
            shape = None if hidden is None else tuple(hidden.shape)
            raise EngineFailed(f"{self.endpoint}: hidden states of shape {shape} for other tokens than asked (expected "
                               f"{expected} for the {len(ids)} sent)")
        if not bool(torch.isfinite(hidden).all()):
            raise EngineFailed(f"{self.endpoint}: hidden states that are not finite")
        return hidden.float().reshape(len(ids), -1)

    def read(self, path: Path) -> dict[str, torch.Tensor]:
        """The file the engine wrote — only inside our storage directory, a regular file, never through a link —
        once the writer's lock is released; then it and its lock are deleted."""
        from safetensors.torch import load

        if path.parent.resolve() != self.storage or path.name.startswith("."):
            raise EngineFailed(f"{self.endpoint}: hidden states at {path}, outside {self.storage}: not read")
        lock = path.with_name(path.name + ".lock")
        try:
            with open(lock, "rb") as held:
                fcntl.flock(held, fcntl.LOCK_SH)  # sleeps until the writer (vLLM's thread) releases its lock
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise EngineFailed(f"{path} is not a regular file: not read")
                data = f.read()
        except OSError as e:
            raise EngineFailed(f"{self.endpoint}: its hidden states at {path} cannot be read: {e}") from None
        finally:
            for done in (path, lock):
                done.unlink(missing_ok=True)
        return load(data)


@contextmanager
def engine_features(cfg: TrainConfig, target_dir: str, layer_ids: list[int], hidden_size: int, devices: list[str],
                    log_path: Path, log: Callable[[str], None]) -> Iterator[EngineFeatures]:
    """vLLM serving the target's hidden states for the run; stopped (and its files removed) when the block ends."""
    dtype = cfg.target_dtype if cfg.target_dtype != "auto" else ("bfloat16" if devices else "float32")
    storage = Path(tempfile.mkdtemp(prefix="flashdraft-hidden-states-"))  # 0700: ours alone
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FIXES), os.environ.get("PYTHONPATH")]))}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.split(":")[1] for d in devices)
    try:
        log(f"train: target features from vLLM ({engine_python(cfg)}), layers {[i + 1 for i in layer_ids]} in "
            f"its numbering, {dtype}; log: {log_path}")
        def command(where: Path) -> list[str]:
            return extraction_command(engine_python(cfg), target_dir, layer_ids, where, storage, cfg.max_length + 16,
                                      dtype, devices)

        with served(command, log_path, log, env=env) as endpoint:
            source = EngineFeatures(endpoint, storage, layer_ids, hidden_size, log_path)
            try:
                yield source
            finally:
                source.pool.shutdown(wait=True)
    finally:
        shutil.rmtree(storage, ignore_errors=True)

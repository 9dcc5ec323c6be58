"""A target fleet: vLLM servers already running on other hosts give the trainers the target's hidden states
(`train.engine_urls`), through a directory shared at the same path (`train.engine_storage`).

    flashdraft run CONFIG.yaml --from train --dry-run     # the fleet's recipe: the key, then each server's command

**Only the run can reach a server.** The fleet's key is a random token in `engine_storage/.flashdraft-fleet-key`
(0600), made whole under a private name and linked into place without replacing one, so a reader never sees part of
it. The printed command does not start without a key file holding a whole key; before any work train sends each
server one request without the key and refuses a server that answers it.

**A server is proven by what it computes.** Before any work, a fixed probe's states at every layer the run uses are
compared with the states the trainer computes from the target's own weights, streamed one layer at a time from its
safetensors (model/streamed.py): a server whose decoder differs (a fine-tune sharing the target's embedding, norm and
head; another checkpoint; other layers under the right name) is refused in one line naming it and the first layer
that differs. The proof is made again before every checkpoint, so a checkpoint is written only on states proven
since the last one, and each checkpoint's manifest records its proof.

**Every failure a user fixes by starting something says what to start, in order**: the key (where it is), then
each server's exact command (`fleet_recipe`), the target named as the user gave it.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import torch

from flashdraft.config import TrainConfig
from flashdraft.errors import ExpectedFailure
from flashdraft.served import SERVED_NAME, VLLM_CPU_FIXES, Endpoint, EngineFailed, ask
from flashdraft.train.engine_features import (
    PROBE,
    EngineFeatures,
    Judge,
    check_version,
    clear_leftovers,
    extraction_command,
    open_regular,
)

FLEET_KEY = ".flashdraft-fleet-key"  # in engine_storage: the fleet's API key, mode 0600
KEY_CHARS = 43  # secrets.token_urlsafe(32): 256 random bits
KEY_WAIT_S = 5.0  # a key being linked into place by another trainer: waited for, not reported


# ---------------------------------------------------------------------------------------------- the key


def key_path(cfg: TrainConfig) -> Path:
    return Path(cfg.engine_storage or "") / FLEET_KEY


def make_fleet_key(storage: Path) -> bool:
    """The fleet's key in `storage`, made if there is none: written whole under a private name, then linked into
    place (a link never replaces a file), so every reader sees a whole key or none. True when this call made it."""
    path = storage / FLEET_KEY
    if path.is_file() or path.is_symlink():
        return False
    private = storage / f".flashdraft-fleet-key-{secrets.token_hex(8)}.tmp"
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(private, path)
            return True
        except FileExistsError:  # another trainer's key came first: theirs is the fleet's
            return False
    finally:
        private.unlink(missing_ok=True)


def fleet_key(storage: Path) -> str:
    """The fleet's key, read from `storage` (made there first if none is): its owner's alone, whole. A key missing
    for a moment (another trainer linking it in) is waited for; one that others can read, or short, is refused."""
    path = storage / FLEET_KEY
    make_fleet_key(storage)
    deadline = time.monotonic() + KEY_WAIT_S
    while True:
        try:
            with open_regular(path) as f:
                mode = os.fstat(f.fileno()).st_mode
                key = f.read(1024).decode("ascii", "replace").strip()
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise EngineFailed(f"the fleet's key {path} disappeared while it was read: something else deletes "
                                   "files in train.engine_storage") from None
            time.sleep(0.05)
        except OSError as e:
            raise EngineFailed(f"the fleet's key {path} cannot be read: {e}") from None
    if mode & 0o077 or len(key) < KEY_CHARS:
        raise EngineFailed(f"the fleet's key {path} is readable by others or too short: delete it, and the next "
                           "train makes a new one (restart the servers with the commands it prints)")
    return key


# ---------------------------------------------------------------------------------------------- the commands


def served_name(layer_ids: list[int]) -> str:
    """The name a fleet server serves the target under: it says which layers (flashdraft's numbering) it gives."""
    return f"{SERVED_NAME}-layers-{'-'.join(map(str, layer_ids))}"


def fleet_command(cfg: TrainConfig, layer_ids: list[int], url: str, python: str = "python") -> str:
    """The command that starts the fleet server at `url` for this run, as the user runs it on that host (and as the
    tests start it): the target as the user named it (`train.target`), that URL's host and port only, tensor-parallel
    over `train.engine_gpus` (0: vLLM's CPU build, float32, with flashdraft's CPU fixes). It takes the key from the
    shared directory into VLLM_API_KEY (never onto its command line) and does not start without a whole key there:
    vLLM given an empty key would check none."""
    from flashdraft.model.resolve import EMBEDDED_TARGET, resolve_model

    parts = urlsplit(url)
    storage = Path(cfg.engine_storage or "")
    cpu = cfg.engine_gpus == 0
    model = resolve_model(cfg.target, log=lambda s: None) if cfg.target == EMBEDDED_TARGET else cfg.target
    command = extraction_command(python, model, layer_ids, parts.port or 80, storage, cfg.max_length + 16,
                                 "float32" if cpu else "bfloat16", [] if cpu else ["GPU"] * cfg.engine_gpus,
                                 served_name(layer_ids), host=parts.hostname or "")
    key = shlex.quote(str(storage / FLEET_KEY))
    start = (f"PYTHONPATH={shlex.quote(str(VLLM_CPU_FIXES))} " if cpu else "") + shlex.join(command)
    return (f'if VLLM_API_KEY="$(cat {key})" && [ "${{#VLLM_API_KEY}}" -ge {KEY_CHARS} ]; then export VLLM_API_KEY; '
            f"{start}; else echo \"no whole fleet key in {key}: nothing started (flashdraft run CONFIG --from train "
            "--dry-run makes it)\" >&2; false; fi")


def run_layers(cfg: TrainConfig, text_config) -> list[int]:
    """The layers a fleet server gives this run (flashdraft's numbering): the drafter's target layers (set, taken from
    `init_from`'s drafter, or spread uniformly) and the target's last, whose state its final norm and head read."""
    from flashdraft.model.drafter import uniform_layer_ids

    get = text_config.get if isinstance(text_config, dict) else (lambda k, d=None: getattr(text_config, k, d))
    layers = get("num_hidden_layers")
    ids = cfg.target_layer_ids
    if not ids and cfg.init_from:
        ids = json.loads((Path(cfg.init_from) / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    ids = list(ids or uniform_layer_ids(layers, cfg.num_layers))
    return ids + ([] if layers - 1 in ids else [layers - 1])


def fleet_recipe(cfg: TrainConfig, layer_ids: list[int], key_made: bool | None = None) -> list[str]:
    """What to start for this run's fleet, in order: the key (where it is, and who must read it), then each server's
    command on its host. The lines `run --dry-run` prints and every failure a started server would fix ends with."""
    key = key_path(cfg)
    state = " (made now)" if key_made else " (flashdraft makes it on the first dry run or train)" if key_made is None \
        else ""
    lines = [f"1. the fleet's key: {key}{state}, mode 0600 — run each vLLM server as the user that owns it, on a "
             "host that mounts train.engine_storage at this same path"]
    for n, url in enumerate(cfg.engine_urls, start=2):
        lines.append(f"{n}. on {urlsplit(url).hostname}: {fleet_command(cfg, layer_ids, url)}")
    lines.append(f"{len(cfg.engine_urls) + 2}. then train (each server loads the target first: minutes)")
    return lines


def fleet_layers(cfg: TrainConfig) -> list[int]:
    """The run's fleet layers, from the target's config on this machine (the trainer needs its embedding and head)."""
    from transformers import AutoConfig

    from flashdraft.model.resolve import resolve_model

    return run_layers(cfg, AutoConfig.from_pretrained(resolve_model(cfg.target, log=lambda s: None)).get_text_config())


def recipe_line(cfg: TrainConfig, layer_ids: list[int] | None, key_made: bool = False) -> str:
    """The recipe on one line, for an error that a started fleet would fix."""
    if layer_ids is None:
        return (f"start the fleet as `flashdraft run CONFIG --from train --dry-run` prints it (the fleet's key: "
                f"{key_path(cfg)}{', made now' if key_made else ''})")
    return "start the fleet, in this order: " + " ".join(fleet_recipe(cfg, layer_ids, key_made))


# ---------------------------------------------------------------------------------------------- before any work


def check_fleet(cfg: TrainConfig) -> str:
    """Preflight: the shared directory is here, the key is there (made now, and said), and every server answers with
    the key, refuses without it, and serves this run's layers by name. Its proof by content is train's, before any
    work (`fleet_features`): it needs the target's weights."""
    storage = Path(cfg.engine_storage or "")
    if not storage.is_dir() or not os.access(storage, os.R_OK | os.W_OK | os.X_OK):
        raise EngineFailed(f"train.engine_storage {storage}: not a directory this machine can read and delete "
                           "in (the fleet's servers write their hidden states there)")
    made = make_fleet_key(storage)
    try:
        layers = fleet_layers(cfg)
    except (OSError, ValueError, KeyError, ExpectedFailure):  # the target's own check says what is wrong with it
        layers = None
    key = fleet_key(storage)
    for url in cfg.engine_urls:
        reachable(Endpoint(url=url.rstrip("/"), api_key=key), layers, cfg, made)
    return (f"vllm fleet: {len(cfg.engine_urls)} server(s) answer with the key and only with it, hidden states in "
            f"{storage}" + (f"; made the fleet's key {key_path(cfg)} now" if made else ""))


def reachable(endpoint: Endpoint, layers: list[int] | None, cfg: TrainConfig, key_made: bool = False) -> dict:
    """The server's model list with the key; refused where it does not answer, refuses the key, answers without it,
    or serves other layers — each with the recipe that starts it right. Returns the entry of this run's layers."""
    how = recipe_line(cfg, layers, key_made)
    try:
        models = json.loads(ask(endpoint, "/v1/models", deadline_s=10))["data"]
        listed = [m.get("id") for m in models]
    except EngineFailed as e:  # not answering, or answering without our key
        raise EngineFailed(f"{e}; {how}") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise EngineFailed(f"{endpoint}/v1/models: not an OpenAI model list; {how}") from None
    try:  # vLLM's own version route: a server too old for hybrid targets is refused before it gives zeros
        version = json.loads(ask(endpoint, "/version", deadline_s=10))["version"]
    except (EngineFailed, ValueError, KeyError, TypeError):
        raise EngineFailed(f"{endpoint}/version: it does not say which vLLM it is; {how}") from None
    check_version(str(endpoint), str(version))
    bare = Endpoint(url=endpoint.url)
    if ask(bare, "/v1/models", deadline_s=10, accept_status=True) == b"200":
        raise EngineFailed(f"{endpoint} answers without the fleet's key: anyone who reaches it can use it and train "
                           f"would not know; restart it so it checks the key: {how}")
    if layers is not None and (name := served_name(layers)) not in listed:
        raise EngineFailed(f"{endpoint} serves {listed}, not {name} (the target's hidden states at layers {layers}, "
                           f"which this run needs); {how}")
    return models[listed.index(served_name(layers))] if layers is not None else {}


# ---------------------------------------------------------------------------------------------- the proof


def layer_differences(states_TNH: torch.Tensor, reference_TNH: torch.Tensor) -> list[float]:
    """Each layer's relative L2 distance of a server's states from the reference, over the probe's tokens."""
    def by_layer(x_TNH: torch.Tensor) -> torch.Tensor:  # n × (T·H)
        return x_TNH.float().transpose(0, 1).flatten(1)

    reference = by_layer(reference_TNH)
    return ((by_layer(states_TNH) - reference).norm(dim=1) / reference.norm(dim=1).clamp_min(1e-12)).tolist()


class Fleet(EngineFeatures):
    """The fleet's features, with the proof that each server computes the target: the probe's states held to the
    reference the trainer computed from the target's weights, at every layer the run uses."""

    def __init__(self, *args, reference_TNH: torch.Tensor, tolerance: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference, self.tolerance = reference_TNH, tolerance
        self.proof: dict = {}

    def prove(self, step: int) -> dict:
        """Every server answers the probe with the target's states (within the tolerance) now; the proof, recorded
        in the next checkpoint's manifest. EngineFailed names the server and the first layer that differs."""
        shape = (len(PROBE), len(self.layer_ids), self.hidden_size)
        servers = {}
        answers = self.pool.map(self.one, [PROBE] * len(self.endpoints), self.endpoints,
                                [False] * len(self.endpoints))  # judged here by every layer, not the head alone
        for endpoint, states in zip(self.endpoints, answers, strict=True):
            differences = layer_differences(states.reshape(shape), self.reference)
            for layer, difference in zip(self.layer_ids, differences, strict=True):
                if not difference <= self.tolerance:
                    raise EngineFailed(
                        f"{endpoint} does not compute this run's target: its states at layer {layer} differ from "
                        f"the ones computed from the target's own weights by {difference:.1%} (train.engine_tolerance "
                        f"{self.tolerance:.0%}; layers {self.layer_ids}); serve the target itself there")
            servers[str(endpoint)] = [round(d, 6) for d in differences]
        self.proof = {"step": step, "probe": PROBE, "layers": self.layer_ids, "tolerance": self.tolerance,
                      "relative_l2": servers}
        return self.proof


@contextmanager
def fleet_features(cfg: TrainConfig, target_dir: str, layer_ids: list[int], hidden_size: int, devices: list[str],
                   log_path: Path, log: Callable[[str], None], rank: int = 0, judge: Judge | None = None,
                   reference: Callable[[list[int]], torch.Tensor] | None = None) -> Iterator[Fleet]:
    """The fleet's servers for this run, each checked before any work: reachable with the key and only with it,
    serving these layers by name, and proven by content (`reference`: the target's states for the probe from its
    own weights, T × n × H) — then yielded, their pool shut down when the block ends."""
    assert reference is not None, "a fleet is proven against the target's own states"
    key = fleet_key(Path(cfg.engine_storage or ""))
    endpoints = [Endpoint(url=url.rstrip("/"), api_key=key) for url in cfg.engine_urls]
    reported = {str(e): str(reachable(e, layer_ids, cfg).get("root"))[:500] for e in endpoints}
    if len(set(reported.values())) > 1:  # one run, one target: servers that loaded different models are refused
        raise EngineFailed(f"train.engine_urls: the servers loaded different models under {served_name(layer_ids)}: "
                           f"{reported}")
    started = time.perf_counter()
    reference_TNH = reference(PROBE)
    log(f"train: the probe's states at layers {layer_ids} computed from {target_dir}'s own weights, one layer at a "
        f"time, in {time.perf_counter() - started:.1f} s")
    source = Fleet(endpoints, Path(cfg.engine_storage or ""), layer_ids, hidden_size, "the fleet servers' own logs",
                   served_name(layer_ids), first=rank, judge=judge, log=log, run=str(log_path.parent.resolve()),
                   reference_TNH=reference_TNH, tolerance=cfg.engine_tolerance)
    source.reported = reported
    try:
        if left := clear_leftovers(source.storage, source.prefix):
            log(f"train: removed {left} file(s) a stopped run of this rank left in {source.storage}")
        try:  # each server itself, not retried on another: this is the check that every one of them is right
            proof = source.prove(step=0)
        except EngineFailed as e:
            raise EngineFailed(f"train.engine_urls: {e}") from None
        worst = max(max(d) for d in proof["relative_l2"].values())
        log(f"train: target features from {len(endpoints)} vLLM server(s) ({', '.join(map(str, endpoints))}), layers "
            f"{[i + 1 for i in layer_ids]} in their numbering, through {source.storage}; each proven the target's "
            f"(states within {worst:.2%} of the target's own at every layer, tolerance {cfg.engine_tolerance:.0%})")
        yield source
    finally:
        source.pool.shutdown(wait=True)

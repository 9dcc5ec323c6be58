"""train.feature_source: engine — the target's hidden states from vLLM (its CPU build, started by train with its
hidden-state extraction) give the losses transformers' own features give, step for step, online and offline; the
engine's files are read once and deleted, and the engine stops with the run. Needs `scripts/engines.sh` (CI runs
it); else the engine tests skip and say so."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from flashdraft.config import TrainConfig
from flashdraft.served import INSTALLED_MARKER, EngineFailed
from flashdraft.train import run
from flashdraft.train.engine_features import engine_python
from tests.train.test_train import make_dataset

VLLM = engine_python(TrainConfig())
needs_vllm = pytest.mark.skipif(not (VLLM.is_file() and (VLLM.parents[1] / INSTALLED_MARKER).is_file()),
                                reason=f"vLLM's CPU build is not installed at {VLLM}: run scripts/engines.sh")


@pytest.fixture(scope="module")
def engine_target(tmp_path_factory, smollm2_dir) -> str:
    """A random-weight Llama of SmolLM2's vocabulary with 64-wide heads (vLLM's CPU attention has kernels for
    those, not for the tiny Llama's 8)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("engine-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory):
    """16 sequences of 40–55 tokens in SmolLM2's vocabulary."""
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 49152, (40 + i,), generator=g).tolist() for i in range(16)]
    return make_dataset(tmp_path_factory.mktemp("engine-ds") / "ds", sequences)


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.fixture
def fleet(tmp_path, engine_target):
    """A vLLM server already running, as a target fleet's are: started with the command train prints for it (here on
    a loopback port, vLLM's CPU build), writing hidden states into a directory shared with the trainer, answering
    only requests that carry the fleet's key."""
    from flashdraft.train.fleet import fleet_command, fleet_key
    from tests.servers import free_port_block, http_server

    storage = tmp_path / "shared"
    storage.mkdir()
    port = free_port_block(1)[0]
    url = f"http://127.0.0.1:{port}"
    cfg = TrainConfig(target=engine_target, **SETTINGS, feature_source="engine", engine_urls=[url],
                      engine_storage=str(storage), engine_gpus=0)
    fleet_key(storage)  # made by the first flashdraft that needs it (train, or its preflight)
    line = fleet_command(cfg, [0, 3], url, python=str(VLLM))
    assert "--host 127.0.0.1" in line and "--api-key" not in line  # the key is not on its command line
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with http_server(["bash", "-c", line], port, tmp_path / "fleet-vllm.log", 600, env=env) as served:
        assert served == url
        yield url, storage


def same_head_other_decoder(target: str, path: Path) -> str:
    """The target with its last decoder layer changed, its embedding, final norm and LM head kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.model.layers[-1].parameters():
            p.add_(torch.randn_like(p) * p.std().clamp_min(1e-3) * 0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return str(path)


def same_shape_other_weights(target: str, path: Path) -> str:
    """The target's config and tokenizer with other random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target)).save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return str(path)


SETTINGS = dict(num_layers=1, target_layer_ids=[0, 3], block_size=4, max_anchors=8, batch_size=2, max_steps=6,
                lr=3e-3, checkpoint_every=3, eval_samples=2, max_length=64)


def trains_as_transformers_do(tmp_path, data, settings: dict, **engine_settings) -> None:
    """Train on transformers' features and on the engine's: the losses agree step for step, and the held-out walk
    (its greedy labels from the last layer's states) runs."""
    # layers 0 and 3, the last: vLLM's id for it is the layer count, the state before the final norm, which is
    # flashdraft's hook on that layer too, and what the trainer's own final norm and LM head make labels from
    mine = run(TrainConfig(**settings), data, tmp_path / "transformers", log=print)
    engine = run(TrainConfig(**settings, feature_source="engine", **engine_settings), data, tmp_path / "engine",
                 log=print)
    ours, theirs = losses(tmp_path / "transformers"), losses(tmp_path / "engine")
    assert len(ours) == len(theirs) == 6
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) / abs(a) < 2e-3, (step, a, b)
    assert engine["steps"] == mine["steps"] == 6
    held = [json.loads(line)["heldout"] for line in (tmp_path / "engine" / "metrics.jsonl").read_text().splitlines()
            if "heldout" in json.loads(line)]
    assert held and all(h["serving_acceptance_length"] >= 1 for h in held)


@pytest.mark.slow
@needs_vllm
def test_engine_features_train_as_transformers_features_do(tmp_path, engine_target, chat_dataset):
    """Online, plain labels, from a vLLM train starts itself and stops with the run."""
    trains_as_transformers_do(tmp_path, chat_dataset, dict(target=engine_target, **SETTINGS, features="online"))
    assert "vllm" in (tmp_path / "engine" / "engine-vllm.log").read_text().lower()
    left = subprocess.run(["pgrep", "-f", "extract_hidden_states"], capture_output=True, text=True).stdout
    assert left == "", f"the engine outlived the run: {left}"
    assert not list(tmp_path.glob("**/*.safetensors.lock"))  # read once, deleted


@pytest.mark.slow
@needs_vllm
def test_a_target_fleet_gives_the_targets_distribution_too(tmp_path, engine_target, chat_dataset, fleet):
    """Offline, with the target's own labels and top-4 distillation, from a server already running (a fleet of
    one): the trainer's final norm and LM head over the last layer's states give transformers' distribution."""
    import urllib.error
    import urllib.request

    url, storage = fleet
    with pytest.raises(urllib.error.HTTPError, match="401"):  # without the fleet's key: refused
        urllib.request.urlopen(f"{url}/v1/models", timeout=10)
    shared = dict(engine_urls=[url], engine_storage=str(storage))
    recipe = dict(labels="target", distill_topk=4, features="offline")
    wrong = TrainConfig(target=engine_target, **{**SETTINGS, "target_layer_ids": [1, 3]}, **recipe,
                        feature_source="engine", **shared)
    with pytest.raises(EngineFailed, match=r"not target-layers-1-3 .* start the fleet, in this order: 1\. the "
                                           r"fleet's key: .* 2\. on 127\.0\.0\.1: if VLLM_API_KEY=.* -m vllm"):
        run(wrong, chat_dataset, tmp_path / "wrong", log=print)
    assert not (tmp_path / "wrong" / "features").exists()  # refused before any work

    # Another model of the same shape (another checkpoint, a colleague's fine-tune): the served name and the shape
    # pass; what it computes does not. And a model that shares the target's embedding, final norm and head but not
    # its decoder (the server's next token agrees with the trainer's head): its states at layer 3 are not the target's.
    # Here the trainer holds the other weights and vLLM the target: the same comparison, one server.
    for other, layer in [(same_shape_other_weights(engine_target, tmp_path / "other"), 0),
                         (same_head_other_decoder(engine_target, tmp_path / "decoder"), 3)]:
        impostor = TrainConfig(target=other, **SETTINGS, **recipe, feature_source="engine", **shared)
        with pytest.raises(EngineFailed, match=rf"{url} does not compute this run's target: its states at layer "
                                               rf"{layer} differ"):
            run(impostor, chat_dataset, tmp_path / f"impostor-{layer}", log=print)
        assert not (tmp_path / f"impostor-{layer}" / "features").exists()
    refused = sorted(p.name for p in storage.iterdir() if p.name != ".flashdraft-fleet-key")
    assert refused == []  # the probe's answers were this run's own files, read whole: deleted

    trains_as_transformers_do(tmp_path, chat_dataset, dict(target=engine_target, **SETTINGS, **recipe), **shared)
    # the drafter's manifest says which model each server loaded, as it reported it
    stats = json.loads((tmp_path / "engine" / "drafter" / "manifest.json").read_text())["stats"]
    assert stats["feature_servers"] == {url: engine_target}
    # every file it wrote for us was read once and deleted; the refused run's two files (another run's) are left
    assert sorted(p.name for p in storage.iterdir() if p.name != ".flashdraft-fleet-key") == refused


def test_the_engine_source_keeps_the_targets_layers_where_they_are():
    with pytest.raises(ValueError, match="init_from_target copies the target's decoder layers"):
        TrainConfig(feature_source="engine", init_from_target=True)
    with pytest.raises(ValueError, match="engine_storage"):
        TrainConfig(feature_source="engine", engine_urls=["http://10.0.0.5:8000"])
    TrainConfig(feature_source="engine", labels="target", features="offline", distill_topk=4, architecture="dspark")


def test_status_estimate_and_preflight_know_the_feature_source(cli, tmp_path, monkeypatch):
    from flashdraft.artifact.ownership import mark_output
    from flashdraft.status import describe_progress, work_in_progress

    config = tmp_path / "c.yaml"
    config.write_text(f"workdir: {tmp_path / 'work'}\ntrain:\n  feature_source: engine\n  features: offline\n")
    from flashdraft.config import load_config

    cfg = load_config(config, {})
    out = tmp_path / "work" / "train"
    mark_output(out, "train", total_steps=10, start_step=0, started="2026-12-06T00:00:00+00:00",
                feature_source="engine")
    assert "target features from vLLM" in describe_progress(work_in_progress("train", out / "drafter", cfg))

    estimated = cli("estimate", str(config))
    assert estimated.returncode == 0 and "offline, from vLLM (train.feature_source: engine)" in estimated.stdout

    monkeypatch.setenv("FLASHDRAFT_ENGINES", str(tmp_path / "no-engines"))
    dry = cli("run", str(config), "--from", "train", "--until", "train", "--dry-run")
    assert dry.returncode == 1 and "train feature engine" in dry.stdout + dry.stderr
    assert "run scripts/engines.sh" in dry.stdout + dry.stderr


def test_a_hybrid_targets_slow_path_is_said_before_any_work(cli, tmp_path):
    """Qwen3.5/3.6's Gated-DeltaNet layers run on transformers' reference loop unless flash-linear-attention and
    causal-conv1d import (neither does here): the dry run says so and names the ways out; estimate says what its
    step time assumed."""
    import transformers as t

    from tests.evaluate.test_targets import HYBRID, SHAPE

    target = tmp_path / "hybrid"
    t.Qwen3_5ForCausalLM(t.Qwen3_5TextConfig(**SHAPE, **HYBRID)).save_pretrained(target)
    config = tmp_path / "c.yaml"
    config.write_text(f"workdir: {tmp_path / 'work'}\ntrain:\n  target: {target}\n")
    dry = cli("run", str(config), "--from", "train", "--until", "train", "--dry-run")
    line = next(x for x in (dry.stdout + dry.stderr).splitlines() if "linear attention" in x)
    assert line.split()[0] == "ok" and "3 Gated-DeltaNet layers on transformers' reference loop" in line
    assert "flash-linear-attention" in line and "feature_source: engine" in line

    reference = Path(__file__).parents[1] / "assets" / "qwen3.6-27b-config.json"
    estimated = cli("estimate", "examples/qwen3.6-27b.yaml", "--num-prompts", "900000", "--target-config",
                    str(reference))
    assert estimated.returncode == 0, estimated.stderr
    assert "its 48 Gated-DeltaNet layers assumed on fast kernels" in estimated.stdout


def engine_file_reader(tmp_path):
    """An EngineFeatures over a storage directory, for its file reading alone (no server): 4 tokens × 2 layers × 8."""
    from flashdraft.served import Endpoint
    from flashdraft.train.engine_features import EngineFeatures, expected_bytes

    storage = tmp_path / "storage"
    storage.mkdir()
    source = EngineFeatures([Endpoint(url="http://127.0.0.1:9")], storage, [0, 1], 8, "log")
    return source, storage, expected_bytes(4, 2, 8)


def test_an_engines_file_is_read_within_bounds_and_only_when_it_is_this_requests(tmp_path):
    """The file an answer names is untrusted input: too large for the states it can hold, locked by someone else past
    the deadline, not safetensors, a link, another request's name — each is one line naming the server, and the file
    is not deleted (a file in a shared volume may be someone else's)."""
    import fcntl
    import time

    from safetensors.torch import save_file

    source, storage, most = engine_file_reader(tmp_path)
    request = "flashdraft-0123abcd"

    def written(name: str, data: bytes) -> Path:
        path = storage / name
        path.write_bytes(data)
        path.with_name(name + ".lock").write_bytes(b"")
        return path

    def refused(path: Path, pattern: str, deadline_s: float = 5.0) -> None:
        with pytest.raises(EngineFailed, match=pattern):
            source.read(path, source.endpoints[0], request, most, time.monotonic() + deadline_s)
        assert path.exists() or path.is_symlink()  # never deleted on a failure

    good = storage / f"cmpl-{request}-0-1234.safetensors"
    save_file({"hidden_states": torch.zeros(4, 2, 8), "token_ids": torch.arange(4)}, str(good))
    good.with_name(good.name + ".lock").write_bytes(b"")
    states = source.read(good, source.endpoints[0], request, most, time.monotonic() + 5)
    assert states["token_ids"].tolist() == [0, 1, 2, 3]

    too_big = written(f"cmpl-{request}-big.safetensors", b"\0" * (most + 1))
    refused(too_big, r"127\.0\.0\.1:9.*more than the .* not read")
    refused(written(f"cmpl-{request}-junk.safetensors", b"not a safetensors file at all"), "is not a safetensors file")
    refused(written("cmpl-flashdraft-someone-else.safetensors", b"x"), "not this request's file")
    link = storage / f"cmpl-{request}-link.safetensors"
    link.symlink_to(good)
    link.with_name(link.name + ".lock").write_bytes(b"")
    refused(link, "cannot be read")
    locked = written(f"cmpl-{request}-locked.safetensors", b"x")
    with open(locked.with_name(locked.name + ".lock"), "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer that never finishes
        started = time.monotonic()
        refused(locked, "stayed locked past", deadline_s=0.3)
        assert time.monotonic() - started < 3  # gave up at the deadline, did not wait forever


def test_the_fleets_key_lives_in_the_shared_directory_for_its_owner_alone(tmp_path):
    """Made once (0600), read back the same by every trainer; a key file others can read is refused; the printed
    server command takes it from the file into VLLM_API_KEY, binds the host its URL names, runs on
    train.engine_gpus GPUs, and names the target as the config does."""
    from flashdraft.train.fleet import FLEET_KEY, fleet_command, fleet_key

    key = fleet_key(tmp_path)
    assert fleet_key(tmp_path) == key and len(key) >= 32
    assert (tmp_path / FLEET_KEY).stat().st_mode & 0o777 == 0o600
    cfg = TrainConfig(target="Qwen/Qwen3.6-27B", feature_source="engine", engine_urls=["http://10.1.2.3:8100"],
                      engine_storage=str(tmp_path), engine_gpus=2)
    line = fleet_command(cfg, [1, 9], "http://10.1.2.3:8100")
    assert key not in line and f'if VLLM_API_KEY="$(cat {tmp_path / FLEET_KEY})"' in line
    assert "--host 10.1.2.3 --port 8100" in line and "--tensor-parallel-size 2" in line and "0.0.0.0" not in line
    assert "--model Qwen/Qwen3.6-27B" in line
    (tmp_path / FLEET_KEY).chmod(0o644)
    with pytest.raises(EngineFailed, match="readable by others"):
        fleet_key(tmp_path)


def answering(storage: Path, states: torch.Tensor, chosen: int):
    """A loopback HTTP server answering /v1/completions as vLLM's extraction does: it writes `states` for the ids
    sent into `storage` under the request's id, and says it chose `chosen`. Yields its URL."""
    import http.server
    import threading

    from safetensors.torch import save_file

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            path = storage / f"cmpl-{body['request_id']}-0-abcd1234.safetensors"
            save_file({"hidden_states": states, "token_ids": torch.tensor(body["prompt"])}, str(path))
            path.with_name(path.name + ".lock").write_bytes(b"")
            answer = json.dumps({"choices": [{"token_ids": [chosen]}],
                                 "kv_transfer_params": {"hidden_states_path": str(path)}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_an_answer_is_judged_by_what_it_computed(tmp_path):
    """Without vLLM: states of the right shape for the ids sent are refused when the server's chosen token is not
    among the trainer's top 5 from them (another model), and when they are all zero (vLLM's hybrid bug); the ones
    that agree are read, and only then deleted."""
    from flashdraft.served import Endpoint
    from flashdraft.train.engine_features import EngineFeatures

    ids = [3, 1, 4, 1]
    states = torch.randn(len(ids), 2, 8)
    ours = [7, 8, 9, 10, 11]
    for chosen, kept, pattern in [(42, states, "computes another model than this run's target"),
                                  (7, torch.zeros_like(states), "all zero .* vllm-project/vllm#46301"),
                                  (9, states, None)]:
        storage = tmp_path / f"storage-{chosen}"
        storage.mkdir()
        server, url = answering(storage, kept, chosen)
        source = EngineFeatures([Endpoint(url=url)], storage, [0, 1], 8, "log", judge=lambda hidden: ours)
        try:
            if pattern is None:
                assert torch.equal(source.one(ids, source.endpoints[0]), states.reshape(len(ids), -1))
                assert list(storage.iterdir()) == []  # read, checked, then deleted
            else:
                with pytest.raises(EngineFailed, match=pattern):
                    source.one(ids, source.endpoints[0])
                assert len(list(storage.iterdir())) == 2  # a refused answer's file is left alone
        finally:
            server.shutdown()
            source.pool.shutdown()


def test_a_fleet_server_that_does_not_answer_has_its_sequences_sent_to_another(tmp_path):
    """A fleet of two where one server is down: its rows go to the other, each said in a line; files a stopped
    process of this machine and rank left in the shared directory are removed when it starts again, and no other's."""
    import socket as sockets

    from flashdraft.served import Endpoint
    from flashdraft.train.engine_features import EngineFeatures, clear_leftovers

    ids = [3, 1, 4, 1]
    states = torch.randn(len(ids), 2, 8)
    storage = tmp_path / "storage"
    storage.mkdir()
    with sockets.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{unused.getsockname()[1]}"  # bound, never listening: refused
        server, url = answering(storage, states, 9)
        said = []
        source = EngineFeatures([Endpoint(url=down), Endpoint(url=url)], storage, [0, 1], 8, "log",
                                judge=lambda hidden: [9], log=said.append)
        try:
            got = source.features(torch.tensor([ids, ids, ids]))
            assert torch.equal(got, states.reshape(len(ids), -1).expand(3, -1, -1))
            assert len(said) == 2 and all(f"the sequence goes to {url}" in line for line in said), said
        finally:
            server.shutdown()
            source.pool.shutdown()
    mine = storage / f"cmpl-{source.prefix}dead-0-1.safetensors"
    other_run = EngineFeatures([Endpoint(url=url)], storage, [0, 1], 8, "log", run="/elsewhere/out")
    theirs = [storage / "cmpl-flashdraft-0123456789ab-r0-dead-0-1.safetensors",  # another machine's or run's
              storage / f"cmpl-{other_run.prefix}dead-0-1.safetensors",  # this machine, another run's output
              storage / f"notes-{source.prefix}.txt"]  # not a file vLLM names after a request
    other_run.pool.shutdown()
    for path in (mine, mine.with_name(mine.name + ".lock"), *theirs):
        path.write_bytes(b"x")
    assert clear_leftovers(storage, source.prefix) == 2
    assert sorted(p.name for p in storage.iterdir()) == sorted(p.name for p in theirs)

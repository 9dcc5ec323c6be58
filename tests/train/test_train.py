"""The DFlash drafter and trainer on a tiny random Qwen3-shaped target, on CPU."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.artifact.manifest import build_manifest, read_manifest, verify_dir, write_manifest
from flashdraft.config import TrainConfig
from flashdraft.errors import BadTrainingInput
from flashdraft.model.drafter import DFlashDrafter, draft_config
from flashdraft.model.export import save_drafter
from flashdraft.model.objective import (
    block_attention_mask,
    build_blocks,
)
from flashdraft.model.target import Target
from flashdraft.train import run
from flashdraft.train.step import sequence_step
from tests.forked_cli import run_cli

VOCAB = 128


def make_dataset(path: Path, sequences: list[list[int]], prompt_len: int = 8, ids: list[str] | None = None) -> Path:
    from datasets import Dataset

    rows = {
        "id": ids or [str(i) for i in range(len(sequences))],
        "input_ids": sequences,
        "loss_mask": [[0] * prompt_len + [1] * (len(s) - prompt_len) for s in sequences],
        "num_tokens": [len(s) for s in sequences],
    }
    Dataset.from_dict(rows).save_to_disk(str(path))
    write_manifest(path, build_manifest(path, kind="dataset"))
    return path


def tiny_cfg(target: str, **kw) -> TrainConfig:
    base = dict(target=target, num_layers=2, block_size=8, max_anchors=8, batch_size=2, epochs=1, lr=3e-3,
                checkpoint_every=2, eval_samples=2, mask_token_id=127)
    return TrainConfig(**{**base, **kw})


def quiet(_):
    return None


# ------------------------------------------------------------------------------------------- learning


def test_overfit_one_sequence_reproduces_it_at_block_positions(tiny_target, tmp_path):
    """The label-alignment check: predicting the token AT anchor+k. A one-position shift fails here."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 120, (48,), generator=g)
    mask = torch.ones(48, dtype=torch.long)
    mask[:4] = 0
    cfg = tiny_cfg(tiny_target, max_anchors=64, lr=3e-3)
    target = Target(tiny_target, "cpu", quiet)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=2, block_size=8, mask_token_id=127))
    target.watch(drafter.target_layer_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr)
    losses = []
    for step in range(100):
        result = sequence_step(drafter, target, ids, mask, cfg, torch.Generator().manual_seed(step), "cpu")
        result["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(result["loss"].item())
    # A random tiny target's LM head gives soft logits: the loss falls steadily while argmax turns exact.
    assert losses[-1] < losses[0] * 0.8 and losses[-1] < min(losses[:10])

    anchors = torch.arange(4, 41)
    block_ids, positions, labels, weights = build_blocks(ids, mask, anchors, 8, 127)
    with torch.no_grad():
        features = target.features(ids[None, :40])
        embeds = target.model.get_input_embeddings()(block_ids.view(1, -1))
        hidden = drafter(embeds, features, positions.view(1, -1), torch.arange(40)[None],
                         block_attention_mask(anchors, 8, 40)[None])
        predicted = target.lm_head(hidden).argmax(-1).view(len(anchors), 8)
    same_position = (predicted[:, 1:] == labels[:, 1:]).float().mean().item()
    shifted = (predicted[:, 1:7] == ids[positions[:, 2:]]).float().mean().item()
    assert same_position > 0.9 and shifted < 0.2


def test_the_loss_decay_setting_reaches_the_step(tiny_target):
    """`train.loss_decay_gamma` weighs the step's loss: the paper's γ (4 at block 8) is the default, another differs."""
    ids, mask = torch.randint(0, 120, (40,), generator=torch.Generator().manual_seed(1)), torch.ones(40)
    target = Target(tiny_target, "cpu", quiet)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=1, block_size=8, mask_token_id=127))
    target.watch(drafter.target_layer_ids)

    def loss(**overrides):
        cfg = tiny_cfg(tiny_target, max_anchors=8, **overrides)
        return sequence_step(drafter, target, ids, mask, cfg, torch.Generator().manual_seed(0), "cpu")["loss"].item()

    assert loss() == pytest.approx(loss(loss_decay_gamma=4.0)) and loss() != pytest.approx(loss(loss_decay_gamma=1.0))


def test_training_run_checkpoints_exports_and_reruns_as_done(tiny_target, tiny_dataset, tmp_path):
    out = tmp_path / "out"
    stats = run(tiny_cfg(tiny_target, epochs=2, keep_checkpoints=10), tiny_dataset, out, log=quiet)
    assert stats["steps"] == 10  # (12 − 2 held out) / batch 2 × 2 epochs
    assert verify_dir(out / "drafter") == []
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [
        f"step-{s:07d}" for s in (2, 4, 5, 6, 8, 10)
    ]  # every 2 steps + each epoch end
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 11)) and all(len(m["accuracy_by_position"]) == 7 for m in steps)
    assert any("heldout" in m for m in metrics)
    lines = []
    run(tiny_cfg(tiny_target, epochs=2, keep_checkpoints=4), tiny_dataset, out, log=lines.append)
    assert "already done, verified" in lines[0]  # where checkpoints are kept is not part of what is trained


def test_metrics_go_to_jsonl_and_tensorboard_alike(tiny_target, tiny_dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    run(tiny_cfg(tiny_target, max_steps=4), tiny_dataset, out, log=quiet)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    steps = [m for m in lines if "loss" in m]
    assert [e.step for e in events.Scalars("loss")] == [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([m["loss"] for m in steps])
    # both paces from one step time: a step's 2 sequences of 40–51 tokens, and their 2 × 8 anchors × block 8
    assert all(2 * 8 * 8 / 102 <= m["block_tokens_per_s"] / m["tokens_per_s"] <= 2 * 8 * 8 / 80 for m in steps)
    held = [m["heldout"]["simulated_acceptance_length"] for m in lines if "heldout" in m]
    assert [e.value for e in events.Scalars("heldout_simulated_acceptance_length")] == pytest.approx(held)


def test_the_last_checkpoints_held_out_evaluation_is_the_drafters_with_no_second_pass(tiny_target, tiny_dataset,
                                                                                         tmp_path, monkeypatch):
    import flashdraft.train.loop as loop
    import flashdraft.train.stage as stage

    calls = []
    original = loop.evaluate_heldout
    for module in (loop, stage):  # the loop's evaluations, and the one the export would make after it
        monkeypatch.setattr(module, "evaluate_heldout", lambda *a, **k: calls.append(1) or original(*a, **k))
    out = tmp_path / "out"
    stats = run(tiny_cfg(tiny_target, max_steps=4, checkpoint_every=2), tiny_dataset, out, log=quiet)
    assert len(calls) == 2  # at steps 2 and 4, and not again for the export
    held = [json.loads(line)["heldout"] for line in (out / "metrics.jsonl").open() if "heldout" in line]
    assert stats["heldout"] == held[-1] == read_manifest(out / "drafter").stats["heldout"]
    assert held[-1]["serving_blocks"] > 0


def test_checkpoints_are_pushed_verified_and_old_ones_pruned(tiny_target, tiny_dataset, tmp_path, s3env):
    import uuid

    from flashdraft.artifact.store import open_store
    from flashdraft.artifact.sync import verify_store

    url = f"s3://flashdraft/t-{uuid.uuid4().hex[:10]}/train"
    out, lines = tmp_path / "out", []
    run(tiny_cfg(tiny_target, epochs=2, keep_checkpoints=2, push_to=url), tiny_dataset, out, log=lines.append)
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-0000008", "step-0000010"]
    for name in ("checkpoints/step-0000008", "checkpoints/step-0000010", "drafter"):
        assert verify_store(open_store(f"{url}/{name}")) == [], name
    # keep_checkpoints holds in the store too: older ones deleted once a newer one verified there
    assert {key.split("/")[0] for key in open_store(f"{url}/checkpoints").list()} == {"step-0000008", "step-0000010"}
    assert sum(line.startswith("push:") and "verified" in line for line in lines) == 7  # 6 checkpoints + the drafter
    assert lines[-1].startswith("train: done, verified")  # said only after every push verified

    s3env.client().delete_object(Bucket="flashdraft", Key=url[len("s3://flashdraft/"):] + "/drafter/model.safetensors")
    lines.clear()
    run(tiny_cfg(tiny_target, epochs=2, keep_checkpoints=2, push_to=url), tiny_dataset, out, log=lines.append)
    assert "already done, verified" in lines[0]
    assert verify_store(open_store(f"{url}/drafter")) == []  # the rerun put the missing object back


def test_offline_features_are_the_online_ones_and_are_reused(tiny_target, tiny_dataset, tmp_path):
    from flashdraft.train.feature_cache import FeatureCache

    online, offline = tmp_path / "online", tmp_path / "offline"
    run(tiny_cfg(tiny_target, max_steps=6), tiny_dataset, online, log=quiet)
    lines = []
    run(tiny_cfg(tiny_target, max_steps=6, features="offline"), tiny_dataset, offline, log=lines.append)
    assert any(line.startswith("features: caching") and "MB" in line for line in lines)  # size said first
    assert verify_dir(offline / "features") == [] and not (online / "features").exists()

    cache, target = FeatureCache(offline / "features"), Target(tiny_target, "cpu", quiet)
    target.watch(read_manifest(offline / "features").stats["layer_ids"])
    ids = torch.as_tensor(__import__("datasets").load_from_disk(str(tiny_dataset))[3]["input_ids"])
    exact = target.features(ids[None])[0]
    assert torch.allclose(cache[3], exact, rtol=1e-2, atol=1e-2)  # bf16 storage of the same numbers
    assert torch.allclose(target.features(ids[None, :20])[0], exact[:20], atol=1e-5)  # causal: prefix = slice

    def losses(out):
        return [m["loss"] for m in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in m]

    assert all(abs(a - b) < 0.02 for a, b in zip(losses(online), losses(offline), strict=True))
    # Other settings into the same --out: refused, nothing discarded; once the old drafter and checkpoints are
    # removed, it retrains there and the feature cache (same data, target, layers) is reused.
    with pytest.raises(BadTrainingInput, match="holds drafter trained from other data or settings"):
        run(tiny_cfg(tiny_target, max_steps=8, features="offline"), tiny_dataset, offline, log=quiet)
    assert verify_dir(offline / "drafter") == []
    shutil.rmtree(offline / "drafter")
    shutil.rmtree(offline / "checkpoints")
    lines.clear()
    run(tiny_cfg(tiny_target, max_steps=8, features="offline"), tiny_dataset, offline, log=lines.append)
    assert any(line.startswith("features: already done, verified") for line in lines)


def test_device_settings_per_local_rank():
    from flashdraft.train.distributed import for_rank

    assert for_rank("cuda:0;cuda:1", 1) == "cuda:1" and for_rank("cuda:2;cuda:3", 0) == "cuda:2"
    assert for_rank("cuda:0,cuda:1", 3) == "cuda:0,cuda:1"  # a spread, the same for every rank
    assert for_rank(None, 0) is None
    with pytest.raises(BadTrainingInput, match="local rank 2"):
        for_rank("cuda:0;cuda:1", 2)


# ------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_fail_before_compute(tiny_target, tmp_path):
    from datasets import Dataset

    no_mask = tmp_path / "no-mask"
    Dataset.from_dict({"input_ids": [[1, 2, 3] * 10]}).save_to_disk(str(no_mask))
    write_manifest(no_mask, build_manifest(no_mask, kind="dataset"))
    with pytest.raises(BadTrainingInput, match="loss_mask"):
        run(tiny_cfg(tiny_target), no_mask, tmp_path / "o1", log=quiet)

    big_ids = make_dataset(tmp_path / "vocab", [[5] * 20 + [5000] * 20])
    with pytest.raises(BadTrainingInput, match="outside the target's vocabulary"):
        run(tiny_cfg(tiny_target), big_ids, tmp_path / "o2", log=quiet)

    short = make_dataset(tmp_path / "short", [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]] * 3, prompt_len=2)
    with pytest.raises(BadTrainingInput, match="larger than every sample"):
        run(tiny_cfg(tiny_target, block_size=16), short, tmp_path / "o3", log=quiet)

    with pytest.raises(BadTrainingInput, match="no manifest"):
        run(tiny_cfg(tiny_target), tmp_path / "nowhere", tmp_path / "o4", log=quiet)


# ------------------------------------------------------------------------------------------- resume, DDP


def write_config(path: Path, target: str, **train) -> Path:
    import yaml

    base = dict(target=target, num_layers=2, block_size=8, max_anchors=8, lr=3e-3, eval_samples=2,
                mask_token_id=127)
    path.write_text(yaml.safe_dump({"train": {**base, **train}}))
    return path


def test_train_with_a_config_pushes_to_its_store_as_run_does(cli, tiny_target, tiny_dataset, tmp_path):
    """`flashdraft train --config C` where C names a store (what torchrun on each node runs): checkpoints and the
    drafter go to STORE/train, verified there, without a --push-to."""
    import yaml

    config = write_config(tmp_path / "c.yaml", tiny_target, batch_size=1, max_steps=2, checkpoint_every=1)
    settings = yaml.safe_load(config.read_text()) | {"store": str(tmp_path / "store")}
    config.write_text(yaml.safe_dump(settings))
    cli("train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(tmp_path / "out"), check=True)
    assert cli("verify", str(tmp_path / "store" / "train" / "drafter")).returncode == 0
    assert (tmp_path / "store" / "train" / "checkpoints" / "step-0000002" / "manifest.json").is_file()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_killed_run_resumes_to_the_same_loss_curve_and_weights(cli, tiny_target, tiny_dataset, tmp_path, optimizer):
    config = write_config(tmp_path / "c.yaml", tiny_target, batch_size=1, epochs=2, checkpoint_every=2,
                          optimizer=optimizer)
    straight = tmp_path / "straight"
    cli("train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(straight), check=True)

    killed = tmp_path / "killed"
    args = [sys.executable, "-m", "flashdraft", "train", "--config", str(config), "--data", str(tiny_dataset),
            "--out", str(killed)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step-0000006").exists() and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "drafter").exists()
    resumed = cli("train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(killed), "--resume",
                  check=True)
    assert "resuming from step-" in resumed.stdout

    def curve(out):
        return [(m["step"], m["loss"]) for m in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in m]

    a, b = curve(straight), curve(killed)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 23))  # 11 training samples × 2 epochs
    assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(a, b, strict=True))
    wa = load_file(str(straight / "drafter" / "model.safetensors"))
    wb = load_file(str(killed / "drafter" / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_resume_ignores_an_incomplete_checkpoint(tiny_target, tiny_dataset, tmp_path):
    out = tmp_path / "out"
    run(tiny_cfg(tiny_target, max_steps=4), tiny_dataset, out, log=quiet)
    shutil_rm = __import__("shutil").rmtree
    shutil_rm(out / "drafter")
    (out / "checkpoints" / "step-0000004" / "manifest.json").unlink()  # as if killed before its commit
    lines = []
    run(tiny_cfg(tiny_target, max_steps=4), tiny_dataset, out, log=lines.append)
    assert any("ignoring incomplete checkpoint step-0000004" in line for line in lines)
    assert any("resuming from step-0000002" in line for line in lines)


@pytest.mark.slow
def test_two_process_ddp_matches_single_process_on_the_same_global_batch(tiny_target, tiny_dataset, tmp_path):
    single = write_config(tmp_path / "single.yaml", tiny_target, batch_size=2, max_steps=2, checkpoint_every=1)
    ddp = write_config(tmp_path / "ddp.yaml", tiny_target, batch_size=1, max_steps=2, checkpoint_every=1)
    run_cli("train", "--config", str(single), "--data", str(tiny_dataset), "--out", str(tmp_path / "one"), check=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
         "-m", "flashdraft", "train", "--config", str(ddp), "--data", str(tiny_dataset),
         "--out", str(tmp_path / "two")],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in ("step-0000001", "step-0000002"):
        a = load_file(str(tmp_path / "one" / "checkpoints" / step / "drafter.safetensors"))
        b = load_file(str(tmp_path / "two" / "checkpoints" / step / "drafter.safetensors"))
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), step


@pytest.mark.slow
def test_nproc_per_node_starts_the_processes_itself_as_torchrun_would(tiny_target, tiny_dataset, tmp_path):
    """`train.nproc_per_node: 2` with per-process devices: plain `flashdraft train` (no torchrun) trains as two
    processes — the same checkpoints as torchrun's two — and verifies the drafter they exported; a failing
    process is one line, without the launcher's traceback."""
    by_torchrun = write_config(tmp_path / "torchrun.yaml", tiny_target, batch_size=1, max_steps=2, checkpoint_every=1)
    by_itself = write_config(tmp_path / "itself.yaml", tiny_target, batch_size=1, max_steps=2, checkpoint_every=1,
                             nproc_per_node=2, device="cpu;cpu", target_device="cpu;cpu")
    assert torchrun("train", "--config", str(by_torchrun), "--data", str(tiny_dataset), "--out",
                    str(tmp_path / "a")).returncode == 0
    proc = run_cli("train", "--config", str(by_itself), "--data", str(tiny_dataset), "--out", str(tmp_path / "b"),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the processes' lines on stderr, this command's own on stdout (with --json: only its JSON object there)
    assert "2 process(es)" in proc.stderr and "(from 2 processes)" in proc.stdout
    for step in ("step-0000001", "step-0000002"):
        a = load_file(str(tmp_path / "a" / "checkpoints" / step / "drafter.safetensors"))
        b = load_file(str(tmp_path / "b" / "checkpoints" / step / "drafter.safetensors"))
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), step
    again = run_cli("train", "--config", str(by_itself), "--data", str(tiny_dataset), "--out", str(tmp_path / "b"),
                    "--json", timeout=300)
    assert again.returncode == 0 and "already done, verified" in again.stderr
    assert "starting 2 processes" not in again.stderr  # a done rerun is a no-op here, not two processes loading torch
    [only] = again.stdout.splitlines()  # the processes' lines went to stderr: one JSON object on stdout
    assert json.loads(only)["path"] == str(tmp_path / "b" / "drafter")

    # SIGTERM to the command (a scheduler's stop): both processes stop with it, and it says so in one line
    long_run = write_config(tmp_path / "long.yaml", tiny_target, batch_size=1, max_steps=400, checkpoint_every=1,
                            nproc_per_node=2, device="cpu;cpu", target_device="cpu;cpu")
    stopped = subprocess.Popen([sys.executable, "-m", "flashdraft", "train", "--config", str(long_run), "--data",
                                str(tiny_dataset), "--out", str(tmp_path / "long")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "long" / "checkpoints" / "step-0000002").is_dir():
        assert stopped.poll() is None and time.time() < deadline, stopped.communicate()
        time.sleep(0.1)
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=120)
    assert stopped.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM, and its 2 processes with it" in err.strip().splitlines()[-1]
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "long")], capture_output=True, text=True).stdout
    assert left == "", f"processes left running: {left}"

    # SIGKILL to the command runs none of its code: the processes it started end with it all the same (the kernel
    # tells each that its launcher died)
    killed = subprocess.Popen([sys.executable, "-m", "flashdraft", "train", "--config", str(long_run), "--data",
                               str(tiny_dataset), "--out", str(tmp_path / "killed")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (tmp_path / "killed" / "checkpoints" / "step-0000002").is_dir():
        assert killed.poll() is None and time.time() < deadline
        time.sleep(0.1)
    killed.kill()
    killed.wait()
    deadline = time.time() + 60
    while (left := subprocess.run(["pgrep", "-f", str(tmp_path / "killed")], capture_output=True,
                                  text=True).stdout) and time.time() < deadline:
        time.sleep(0.2)
    assert left == "", f"processes left running after the launcher was killed: {left}"

    # a dataset whose manifest is there (the preflight passes) but one of whose files changed: refused when verified
    changed = tmp_path / "changed-dataset"
    shutil.copytree(tiny_dataset, changed)
    info = changed / "dataset_info.json"
    info.write_text(info.read_text() + " ")
    failed = run_cli("train", "--config", str(by_itself), "--data", str(changed), "--out", str(tmp_path / "c"),
                     timeout=300)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert "of 2 exited 1" in failed.stderr.strip().splitlines()[-1]


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           port, "-m", "flashdraft", *args], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout)


def test_under_torchrun_a_dataset_that_does_not_verify_stops_every_process(tiny_target, tiny_dataset, tmp_path):
    """One process a node re-hashes the dataset; the one that finds it broken names the file, the other says
    where to look, and neither trains."""
    broken = tmp_path / "ds"
    shutil.copytree(tiny_dataset, broken)
    shard = next(broken.glob("data-*.arrow"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # same size, other content
    shard.write_bytes(bytes(data))
    cfg = write_config(tmp_path / "c.yaml", tiny_target, batch_size=1, max_steps=2)
    proc = torchrun("train", "--config", str(cfg), "--data", str(broken), "--out", str(tmp_path / "out"))
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"{shard.name}" in said and "does not verify" in said
    assert "failed its check in the process that checked it for its node" in said
    assert not (tmp_path / "out" / "checkpoints").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_fsdp_checkpoints_save_restore_and_export_the_whole_drafter(tiny_target, tiny_dataset, tmp_path):
    """FSDP on 2 CPU processes (gloo): each checkpoint holds the whole drafter (gathered from the shards) and
    equals a single process's on the same global batch; a run resumed from a checkpoint into the shards ends
    with the weights of an uninterrupted run; the export is the whole trained drafter."""
    single = write_config(tmp_path / "single.yaml", tiny_target, batch_size=2, max_steps=4, checkpoint_every=2)
    fsdp = write_config(tmp_path / "fsdp.yaml", tiny_target, batch_size=1, max_steps=4, checkpoint_every=2,
                        fsdp=True)
    run_cli("train", "--config", str(single), "--data", str(tiny_dataset), "--out", str(tmp_path / "one"), check=True)
    args = ["train", "--config", str(fsdp), "--data", str(tiny_dataset)]
    proc = torchrun(*args, "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in ("step-0000002", "step-0000004"):
        a = load_file(str(tmp_path / "one" / "checkpoints" / step / "drafter.safetensors"))
        b = load_file(str(tmp_path / "two" / "checkpoints" / step / "drafter.safetensors"))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), step
    final = load_file(str(tmp_path / "two" / "checkpoints" / "step-0000004" / "drafter.safetensors"))
    exported = load_file(str(tmp_path / "two" / "drafter" / "model.safetensors"))
    assert all(torch.equal(exported[k], final[k].to(torch.bfloat16)) for k in exported)  # whole, not a shard

    # Resume under FSDP: from step 2, into the shards, to the same end.
    again, resumed = rerun_without_the_end([*args, "--out", str(tmp_path / "two")], tmp_path / "two", "step-0000004")
    assert again.returncode == 0 and "resuming from step-0000002" in again.stdout + again.stderr, again.stderr[-3000:]
    assert all(torch.allclose(resumed[k], final[k], atol=1e-6) for k in final)


def rerun_without_the_end(args: list[str], out: Path, last: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Delete a finished run's export and its `last` checkpoint (as if killed before writing them), run `args`
    again under torchrun: the process, and the weights of the `last` checkpoint it wrote anew."""
    shutil.rmtree(out / "drafter")
    shutil.rmtree(out / "checkpoints" / last)
    again = torchrun(*args)
    written = out / "checkpoints" / last / "drafter.safetensors"
    return again, load_file(str(written)) if written.exists() else {}


def test_init_from_an_existing_drafter_starts_from_its_weights(tiny_target, tiny_dataset, tmp_path):
    first = tmp_path / "first"
    run(tiny_cfg(tiny_target, max_steps=4), tiny_dataset, first, log=quiet)
    lines = []  # a near-zero learning rate: what comes out is what went in (at bf16 export precision)
    run(tiny_cfg(tiny_target, max_steps=1, lr=1e-12, num_layers=3, block_size=16, init_from=str(first / "drafter")),
        tiny_dataset, tmp_path / "second", log=lines.append)
    assert any("starting from" in line and "block 8" in line for line in lines)  # its settings, not ours
    before, after = load_file(str(first / "drafter" / "model.safetensors")), load_file(
        str(tmp_path / "second" / "drafter" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_init_from_a_drafter_of_another_target_is_refused(tiny_target, tiny_dataset, tmp_path):
    from transformers import Qwen3Config

    other = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    save_drafter(DFlashDrafter(draft_config(other, num_layers=1, block_size=8, mask_token_id=127)), tmp_path / "d")
    with pytest.raises(BadTrainingInput, match="made for another target: hidden size 32 vs the target's 64"):
        run(tiny_cfg(tiny_target, init_from=str(tmp_path / "d")), tiny_dataset, tmp_path / "out", log=quiet)


def test_a_replacement_machine_resumes_from_the_stores_newest_checkpoint(tiny_target, tiny_dataset, tmp_path):
    """The first machine pushed checkpoints up to step 4 and died; a second one with an empty disk and the same
    settings pulls step 4 from the store and ends exactly where an uninterrupted run does."""
    cfg = tiny_cfg(tiny_target, max_steps=6, checkpoint_every=2, keep_checkpoints=10)
    run(cfg, tiny_dataset, tmp_path / "uninterrupted", log=quiet)

    store = tmp_path / "store"
    run(cfg.model_copy(update={"push_to": str(store)}), tiny_dataset, tmp_path / "first", log=quiet)
    for name in ("checkpoints/step-0000006", "checkpoints/step-0000005", "drafter"):  # what it never pushed
        shutil.rmtree(store / name)
    shutil.rmtree(tmp_path / "first")

    lines = []
    run(cfg.model_copy(update={"push_to": str(store)}), tiny_dataset, tmp_path / "second", log=lines.append)
    assert any(line.startswith("pull: ") for line in lines)
    assert any("resuming from step-0000004" in line for line in lines)

    def losses(out):
        return {m["step"]: m["loss"] for m in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in m}

    assert losses(tmp_path / "second") == {s: v for s, v in losses(tmp_path / "uninterrupted").items() if s > 4}
    a = load_file(str(tmp_path / "uninterrupted" / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "second" / "drafter" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert verify_dir(store / "drafter") == []  # and it pushed what it made

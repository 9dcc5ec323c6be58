"""The fleet test: the README's multi-machine path, every machine a separate workdir and process, S3 between.

    generation hosts 0, 1   `run --until generate --store S` (generate.shard_index 0 / 1 of 2), each against its
                            own `transformers serve` (openai backend); each pushes its shard
    CPU box                 `run --from tokenize --until tokenize --store S`: pulls both shards, tokenizes, pushes
    training node           `sync pull` the dataset, `torchrun --nproc-per-node 2 -m flashdraft train --push-to`,
                            SIGKILLed once two checkpoints are verified in the store
    replacement node        an empty disk, the same commands: continues from the store's newest checkpoint and
                            ends with the weights and loss curve of an uninterrupted run (trained beside, for
                            reference)
    CPU box                 `run --from eval --until eval --store S`: pulls the drafter, evaluates, pushes
    status host             `status --store S`: every stage verified from the store; one object corrupted in the
                            store flips that stage, and the CPU box's next `run` repairs it

The model throughout is a tiny random-weight Llama with the embedded target's tokenizer and chat template: what is
under test is the machines and the store between them, and it makes each stage seconds, not a minute. Nothing is
mocked: SeaweedFS on 127.0.0.1, real servers, real torchrun. The timeline of what each machine did is
printed (pytest -s) and is part of any failure message.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.forked_cli import run_cli
from tests.servers import alive, children, transformers_serve

# Checkpoints every 2 steps, the store keeps the last 2: "two pushes seen" holds from step 4 on, so the run must be
# long enough that the kill lands mid-run even when this process polls slowly on a loaded machine (at 12 steps a
# loaded run once finished all of them first and the replacement had nothing left to train).
STEPS = 24

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    def __init__(self, root: Path, store: str, model: str, prompts: Path):
        self.root, self.store, self.model, self.prompts = root, store, model, prompts
        self.started = time.perf_counter()
        self.timeline: list[str] = []

    def note(self, machine: str, what: str, began: float, outcome: str) -> None:
        self.timeline.append(f"{began - self.started:7.1f}s–{time.perf_counter() - self.started:7.1f}s  "
                             f"{machine:<17} {what:<58} {outcome}")

    def config(self, machine: str, shard: int = 0, base_url: str | None = None) -> Path:
        workdir = self.root / machine
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = {
            "workdir": str(workdir),
            "generate": {"prompts": str(self.prompts), "backend": "openai", "model": self.model,
                         "base_urls": [base_url] if base_url else [], "max_new_tokens": 24, "batch_size": 3,
                         "num_shards": 2, "shard_index": shard},
            "tokenize": {"tokenizer": self.model, "block_size": 4, "min_loss_fraction": 0.0, "max_length": 256,
                         "workers": 1},
            "train": {"target": self.model, "num_layers": 1, "block_size": 4, "max_anchors": 4, "batch_size": 1,
                      "micro_batch": 1, "max_steps": STEPS, "checkpoint_every": 2, "keep_checkpoints": 2,
                      "eval_samples": 2, "lr": 3e-3},
            "eval": {"target": self.model, "prompts": str(self.prompts), "max_prompts": 2, "max_new_tokens": 12},
        }
        path = workdir / "flashdraft.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def run(self, machine: str, args: list[str], expect_ok: bool = True, launcher: list[str] | None = None):
        began = time.perf_counter()
        command = (launcher or [sys.executable, "-m", "flashdraft"]) + args
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = (subprocess.run(command, capture_output=True, text=True, timeout=600, env=env) if launcher else
                run_cli(*args, timeout=600, env=env))  # the machine's own `flashdraft …` (tests/forked_cli.py)
        short = " ".join(a if "/" not in a else Path(a).name for a in args)[:58]
        self.note(machine, short, began, f"exit {proc.returncode}")
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"{machine}: {' '.join(command)} exited {proc.returncode}\n{self.story()}\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def story(self) -> str:
        return "timeline:\n" + "\n".join(self.timeline)


def torchrun(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            "-m", "flashdraft"]


def curve(train_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (train_dir / "metrics.jsonl").open()) if "loss" in m}


def test_a_fleet_of_machines_runs_the_pipeline_through_the_store(tmp_path, s3env, tiny_model_dir):
    prefix = f"fleet-{uuid.uuid4().hex[:8]}"
    store = f"s3://flashdraft/{prefix}"
    prompts = tmp_path / "prompts.jsonl"
    topics = ["rivers", "bread", "chess", "volcanoes", "owls", "bridges", "tea", "glaciers", "kites", "bees",
              "maps", "lighthouses"]
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me two facts about {t}."}) + "\n" for t in topics))
    fleet = Fleet(tmp_path, store, tiny_model_dir, prompts)
    client = s3env.client()

    def in_store(sub: str) -> list[str]:
        found = client.list_objects_v2(Bucket="flashdraft", Prefix=f"{prefix}/{sub}").get("Contents", [])
        return [o["Key"][len(prefix) + 1 :] for o in found]

    # Two generation hosts, each with its own server, generating and pushing its shard.
    with ExitStack() as servers:
        urls = [servers.enter_context(transformers_serve(tiny_model_dir, tmp_path / f"serve-{i}.log"))
                for i in range(2)]
        for i, url in enumerate(urls):
            host = f"gen-host-{i}"
            fleet.run(host, ["run", str(fleet.config(host, shard=i, base_url=f"{url}/v1")), "--until", "generate",
                             "--store", store])
    assert {k.split("/")[1] for k in in_store("generate/") if k.endswith("manifest.json")} == {"shard-0", "shard-1"}

    # The CPU box refuses to tokenize until both shards verify; with the store it pulls them.
    cpu = fleet.config("cpu-box")
    early = fleet.run("cpu-box", ["tokenize", "--config", str(cpu)], expect_ok=False)
    assert early.returncode == 1 and "generate/shard-0, generate/shard-1" in early.stderr
    fleet.run("cpu-box", ["run", str(cpu), "--from", "tokenize", "--until", "tokenize", "--store", store])
    dataset_stats = json.loads((tmp_path / "cpu-box" / "dataset" / "manifest.json").read_text())["stats"]
    assert dataset_stats["samples"] == 12

    # The training node: pull the dataset, train with 2 processes, pushing checkpoints; killed mid-run.
    node = fleet.config("train-node")
    fleet.run("train-node", ["sync", "pull", f"{store}/dataset", str(tmp_path / "train-node" / "dataset")])
    train_args = ["train", "--config", str(node), "--data", str(tmp_path / "train-node" / "dataset"), "--out",
                  str(tmp_path / "train-node" / "train"), "--push-to", f"{store}/train"]
    began = time.perf_counter()
    proc = subprocess.Popen(torchrun(free_port()) + train_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 300
    while len([k for k in in_store("train/checkpoints/") if k.endswith("manifest.json")]) < 2:
        assert proc.poll() is None and time.time() < deadline, f"training ended before two pushes\n{fleet.story()}"
        time.sleep(0.05)
    workers = children(proc.pid)  # torchrun starts each in a session of its own: the group kill misses them
    assert len(workers) == 2, workers
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # with their launcher gone they end (train/launch.py die_with_launcher): an orphan would train on and push
    # checkpoints beside the replacement node's
    deadline = time.time() + 30
    while any(alive(pid) for pid in workers):
        assert time.time() < deadline, f"torchrun's processes outlived it: {workers}"
        time.sleep(0.1)
    pushed = sorted({k.split("/")[2] for k in in_store("train/checkpoints/") if k.endswith("manifest.json")})
    fleet.note("train-node", f"torchrun train --push-to (SIGKILLed; store has {', '.join(pushed)})", began, "killed")
    assert not in_store("train/drafter/")

    # The replacement node: an empty disk, the same commands; it continues from the store.
    spare = fleet.config("replacement-node")
    spare_data = tmp_path / "replacement-node" / "dataset"
    fleet.run("replacement-node", ["sync", "pull", f"{store}/dataset", str(spare_data)])
    spare_args = ["train", "--config", str(spare), "--data", str(spare_data), "--out",
                  str(tmp_path / "replacement-node" / "train"), "--push-to", f"{store}/train"]
    resumed = fleet.run("replacement-node", spare_args, launcher=torchrun(free_port()))
    assert "resuming from step-" in resumed.stdout + resumed.stderr, fleet.story()

    # For reference, the same training uninterrupted (same data, settings and world size; no store).
    ref = fleet.config("reference-node")
    fleet.run("reference-node", ["train", "--config", str(ref), "--data", str(spare_data), "--out",
                                 str(tmp_path / "reference-node" / "train")], launcher=torchrun(free_port()))
    mine, theirs = curve(tmp_path / "replacement-node" / "train"), curve(tmp_path / "reference-node" / "train")
    assert mine and set(mine) <= set(theirs) and max(mine) == max(theirs) == STEPS
    assert all(abs(mine[s] - theirs[s]) < 1e-4 for s in mine), (mine, theirs)
    final = Path("train") / "checkpoints" / f"step-{STEPS:07d}" / "drafter.safetensors"  # fp32, before the bf16 export
    a = load_file(str(tmp_path / "replacement-node" / final))
    b = load_file(str(tmp_path / "reference-node" / final))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    # keep_checkpoints holds in the store too
    assert len({k.split("/")[2] for k in in_store("train/checkpoints/") if k.endswith("manifest.json")}) <= 2

    # The CPU box evaluates the drafter from the store.
    fleet.run("cpu-box", ["run", str(cpu), "--from", "eval", "--until", "eval", "--store", store])

    # A fifth machine sees every stage verified from the store …
    watcher = fleet.config("status-host")

    def store_rows() -> dict[str, bool]:
        out = fleet.run("status-host", ["status", "--config", str(watcher), "--store", store, "--json"])
        rows = json.loads(out.stdout.strip().splitlines()[-1])["stages"]
        return {f"{r['stage']}:{Path(r['artifact']).name}": r["verified"] for r in rows if r["where"] == "store"}

    assert store_rows() == {"generate:shard-0": True, "generate:shard-1": True, "tokenize:dataset": True,
                            "train:drafter": True, "eval:eval": True}, fleet.story()
    # … and a corrupted object flips its stage, until the CPU box's next run repairs it.
    victim = next(k for k in in_store("dataset/") if k.endswith(".arrow"))
    client.put_object(Bucket="flashdraft", Key=f"{prefix}/{victim}", Body=b"corrupted")
    assert store_rows()["tokenize:dataset"] is False
    fleet.run("cpu-box", ["run", str(cpu), "--from", "tokenize", "--until", "tokenize", "--store", store])
    assert all(store_rows().values()), fleet.story()
    print("\n" + fleet.story())

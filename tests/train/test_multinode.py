"""Several nodes as one command each (train.nnodes): two "nodes" on 127.0.0.1, one process each, started as a user
starts them (`flashdraft train --config C --node-rank R` on each, the same config), train as one node with two
processes does — the same losses — and node 0's drafter verifies in the store, checked from node 1 too."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.train.test_train import write_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_processes_and_push_one_drafter(cli, tiny_target, tiny_dataset, tmp_path):
    store = tmp_path / "store"
    one_node = write_config(tmp_path / "one.yaml", tiny_target, batch_size=1, max_steps=3, checkpoint_every=1,
                            nproc_per_node=2, device="cpu;cpu", target_device="cpu;cpu")
    two_nodes = write_config(tmp_path / "two.yaml", tiny_target, batch_size=1, max_steps=3, checkpoint_every=1,
                             nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", push_to=str(store))
    cli("train", "--config", str(one_node), "--data", str(tiny_dataset), "--out", str(tmp_path / "one"), check=True)

    nodes = [subprocess.Popen([sys.executable, "-m", "flashdraft", "train", "--config", str(two_nodes), "--data",
                               str(tiny_dataset), "--out", str(tmp_path / f"node-{rank}"), "--node-rank", str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert "as node 1 of 2" in outputs[1][0] and "node 0's export, checked from node 1" in outputs[1][0]

    ours, one = losses(tmp_path / "node-0"), losses(tmp_path / "one")
    assert len(ours) == len(one) == 3
    assert all(abs(a - b) / abs(b) < 1e-3 for a, b in zip(ours, one, strict=True)), (ours, one)
    assert cli("verify", str(store / "drafter")).returncode == 0
    assert not (tmp_path / "node-1" / "drafter").exists()  # one drafter, node 0's


def node(config, data, out, rank: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flashdraft", "train", "--config", str(config), "--data", str(data),
                             "--out", str(out), "--node-rank", str(rank)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_killed_node_leaves_one_line_and_the_same_commands_resume_from_the_store(cli, tiny_target, tiny_dataset,
                                                                                   tmp_path):
    """Node 1 killed (SIGKILL) mid-run: node 0 says in one line that it lost the others; the same two commands,
    rerun, pull the newest checkpoint from the store and finish, and the drafter verifies there."""
    store = tmp_path / "store"
    config = write_config(tmp_path / "two.yaml", tiny_target, batch_size=1, max_steps=40, checkpoint_every=1,
                          nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", push_to=str(store))
    first = [node(config, tiny_dataset, tmp_path / f"node-{rank}", rank) for rank in (0, 1)]
    deadline = time.time() + 300
    while not (store / "checkpoints" / "step-0000002").is_dir():
        assert all(n.poll() is None for n in first) and time.time() < deadline, [n.communicate() for n in first]
        time.sleep(0.05)
    first[1].send_signal(signal.SIGKILL)
    first[1].wait()
    _, err = first[0].communicate(timeout=300)
    assert first[0].returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "lost its connection to the others" in err and "exited 1" in err.strip().splitlines()[-1]
    assert not (store / "drafter").exists()

    again = [node(config, tiny_dataset, tmp_path / f"node-{rank}", rank) for rank in (0, 1)]
    outputs = [n.communicate(timeout=600) for n in again]
    for n, (_, err) in zip(again, outputs, strict=True):
        assert n.returncode == 0, err[-3000:]
    resumed = [line for line in outputs[0][1].splitlines() if "resuming from step-" in line]
    assert resumed and "resuming from step-0000000" not in resumed[0], outputs[0][1][-3000:]
    assert cli("verify", str(store / "drafter")).returncode == 0


def test_several_nodes_need_a_rendezvous_and_a_rank_among_them(cli, tmp_path, tiny_target):
    from flashdraft.config import TrainConfig

    with pytest.raises(ValueError, match="needs rdzv_endpoint"):
        TrainConfig(nnodes=2)
    with pytest.raises(ValueError, match="ranks are 0 … 1"):
        TrainConfig(nnodes=2, rdzv_endpoint="head:29500", node_rank=2)


@pytest.mark.slow
def test_nodes_that_differ_in_what_they_train_on_are_refused_naming_the_node(tiny_target, tiny_dataset, tmp_path):
    """Each node names its own --data and config: node 1 holding another dataset, or another learning rate, would
    average its gradients into every step (or drift apart). Once the group is up every node compares, and both
    exit 1 with one line naming node 1 and what differs, before any step."""
    import torch

    from tests.train.test_train import make_dataset

    other = make_dataset(tmp_path / "other-data", [torch.randint(0, 120, (44,)).tolist() for _ in range(12)])
    for name, node_1, what in [("data", ({}, other), "another dataset"),
                               ("lr", ({"lr": 1e-2}, tiny_dataset), "another config")]:
        endpoint = f"127.0.0.1:{free_port()}"  # both nodes meet at node 0's
        configs = [write_config(tmp_path / f"{name}-{rank}.yaml", tiny_target, batch_size=1, max_steps=3, nnodes=2,
                                rdzv_endpoint=endpoint, **settings)
                   for rank, settings in enumerate([{}, node_1[0]])]
        nodes = [node(configs[rank], data, tmp_path / f"{name}-{rank}", rank)
                 for rank, data in enumerate([tiny_dataset, node_1[1]])]
        outputs = [n.communicate(timeout=300) for n in nodes]
        for n, (_, err) in zip(nodes, outputs, strict=True):
            assert n.returncode == 1 and "Traceback" not in err, err[-3000:]
            assert f"node 1 (rank 1) joined this run with {what} than rank 0" in err, err[-2000:]
        assert not (tmp_path / f"{name}-0" / "checkpoints").exists()


@pytest.mark.parametrize("rank", [1, 0])
def test_a_node_waiting_for_the_others_says_where_and_stops_at_once(tiny_target, tiny_dataset, tmp_path, rank):
    """Node 1 with no node 0 to meet (and node 0 with no node 1): it says where it waits, and SIGTERM ends it in one
    error line within seconds — not after torch's store timeout (600 s here), with its C++ stack frames."""
    config = write_config(tmp_path / "two.yaml", tiny_target, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                          rdzv_timeout_s=600)
    waiting = node(config, tiny_dataset, tmp_path / "out", rank)
    lines, deadline = [], time.time() + 120
    while time.time() < deadline:
        line = waiting.stderr.readline()
        lines.append(line)
        if "waiting for" in line or not line:
            break
    assert "waiting for" in lines[-1] and ("node 0 at 127.0.0.1:" if rank else "to join at 127.0.0.1:") in lines[-1]
    assert "of 600 s, train.rdzv_timeout_s" in lines[-1], lines
    time.sleep(2)  # inside torch's wait by now
    stopped = time.time()
    waiting.send_signal(signal.SIGTERM)
    _, err = waiting.communicate(timeout=60)
    assert time.time() - stopped < 15 and waiting.returncode == 1
    rest = [line for line in err.splitlines() if line.strip() and "waiting for" not in line]
    assert len(rest) <= 2 and "stopped by SIGTERM while waiting for" in err and "Traceback" not in err, err


def test_a_node_without_the_dataset_pulls_it_from_the_configs_store_before_training(cli, tiny_target, tiny_dataset,
                                                                                       tmp_path):
    """`flashdraft train --config C` on a fresh node whose config names the store the dataset was pushed to: the
    dataset is pulled and verified before anything trains (a node of several: before the nodes meet); without a
    store, the missing dataset is refused by the preflight in one line."""
    import yaml

    store = tmp_path / "store"
    cli("sync", "push", str(tiny_dataset), str(store / "dataset"), check=True)
    config = write_config(tmp_path / "c.yaml", tiny_target, max_steps=1, checkpoint_every=1)
    settings = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**settings, "store": str(store)}))
    fresh = tmp_path / "node-1" / "dataset"
    done = cli("train", "--config", str(config), "--data", str(fresh), "--out", str(tmp_path / "out"), check=True)
    assert f"pull: {fresh} — downloaded" in done.stdout and (fresh / "manifest.json").is_file(), done.stdout
    refused = cli("train", "--config", str(write_config(tmp_path / "bare.yaml", tiny_target)), "--data",
                  str(tmp_path / "nowhere"), "--out", str(tmp_path / "out-2"))
    assert refused.returncode == 1 and "no dataset at" in refused.stderr and "Traceback" not in refused.stderr

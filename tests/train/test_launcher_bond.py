"""A training process never outlives its launcher, however early the launcher dies: the launcher is fixed at the
interpreter's start, before seconds of imports (flashdraft/guard.py bind_to_launcher). torchrun SIGKILLed while its
process was still starting used to leave that process re-parented, asking to die with its new parent, and training
and pushing beside the run that replaced it."""

import os
import signal
import socket
import subprocess
import sys
import time

import yaml

from tests.servers import alive, children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_session(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3]) == pid  # the 6th field of stat is the session
    except OSError:
        return False


def test_a_process_whose_torchrun_is_killed_while_it_starts_ends_at_once_in_one_line(tiny_target, tiny_dataset,
                                                                                    tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"workdir": str(tmp_path / "work"), "train": {
        "target": tiny_target, "num_layers": 1, "block_size": 8, "max_anchors": 4, "batch_size": 1,
        "max_steps": 100000, "checkpoint_every": 2, "eval_samples": 2, "mask_token_id": 127}}))
    out = tmp_path / "out"
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
         "-m", "flashdraft", "train", "--config", str(config), "--data", str(tiny_dataset), "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 120
    # The training process exists and has its own session: it is starting its interpreter. (Between fork and setsid
    # it is still in torchrun's group, and the group's SIGKILL below would end it with no chance to speak.)
    while not (workers := [pid for pid in children(torchrun.pid) if own_session(pid)]):
        assert torchrun.poll() is None and time.time() < deadline, "torchrun started no process"
        time.sleep(0.005)
    os.killpg(torchrun.pid, signal.SIGKILL)  # a scheduler's kill, mid start-up (the worker is in its own session)
    torchrun.wait()
    deadline = time.time() + 30
    while any(alive(pid) for pid in workers):
        assert time.time() < deadline, f"the training process outlived torchrun: {workers}"
        time.sleep(0.05)
    said = torchrun.stderr.read()
    assert "this training process's launcher (pid" in said and "is gone: stopped before any work" in said, said
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()

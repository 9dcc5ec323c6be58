"""Training processes on one node, started by flashdraft itself: `train.nproc_per_node: N` (N > 1) makes `train`
and `run` launch N copies of `flashdraft train` through torch's own elastic launcher — what `torchrun --standalone
--nproc-per-node N` does, called as a library so that a failed rank ends in one line, not the launcher's traceback.

Each process gets RANK / LOCAL_RANK / WORLD_SIZE as under torchrun and picks its entry of an "a;b" device setting
(train/distributed.py). The rendezvous is on localhost with a free port the launcher picks. Several nodes: start
`torchrun … -m flashdraft train` on each yourself (docs/train.md).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from contextlib import contextmanager

from flashdraft.errors import ExpectedFailure


class TrainProcessFailed(ExpectedFailure):
    """A training process exited non-zero; it printed its own error above."""


def under_a_launcher() -> bool:
    """This process is one of torchrun's (or flashdraft's own launch): it trains, it does not launch."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


LAUNCHER_PID = "FLASHDRAFT_LAUNCHER_PID"  # set by launch() for its processes: whose death ends them
PEER_STOP_GRACE_S = 10.0  # the launcher sees a process end within a second and stops the others at once


# what torch's collectives say when a peer process is gone (gloo's TCP pairs, NCCL's aborted communicators)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


@contextmanager
def waiting_for_the_launchers_stop():
    """One process of several whose step failed because a peer stopped or died (gloo: "Connection closed by peer")
    is stopped by its launcher a moment later (SIGTERM, raised here as Stopped: one line), and the launcher's own
    line says which process failed first. So it waits for that stop before calling its failure a bug. A lost peer
    that no stop follows (another node died) is one line that says so; any other failure is this process's own,
    and keeps its traceback."""
    try:
        yield
    except ExpectedFailure:
        raise
    except Exception as e:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            raise
        time.sleep(PEER_STOP_GRACE_S)
        if any(words in str(e) for words in PEER_LOST):
            raise TrainProcessFailed(
                f"train: process {os.environ.get('RANK', '?')} of {world} lost its connection to the others (another "
                "process or node stopped or failed; its own log says why). Rerun the same command on every node: it "
                "resumes from the newest checkpoint") from None
        raise


def die_with_launcher() -> None:
    """A process flashdraft's own launcher started ends when that launcher dies, even by SIGKILL (which runs no
    cleanup of the launcher's): the kernel sends it SIGTERM (guard.py). Under torchrun, torchrun's rules apply."""
    from flashdraft.guard import die_with_parent

    if under_a_launcher() and os.environ.get(LAUNCHER_PID, "").isdigit():
        die_with_parent(int(os.environ[LAUNCHER_PID]))


def launch(nproc: int, train_args: list[str], nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None) -> None:
    """Run `python -m flashdraft train ARGS` as `nproc` processes of one job (on one node, or as node `node_rank` of
    `nnodes`, meeting at node 0's `rdzv_endpoint` as torchrun's static rendezvous does); returns when all exited 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[LAUNCHER_PID] = str(os.getpid())  # inherited by the processes it starts (die_with_launcher)
    threads_set = "OMP_NUM_THREADS" in os.environ
    if not threads_set:  # torchrun's reason: N processes must not each take every core (theirs only, not ours)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if nnodes == 1:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    else:  # node 0 hosts the rendezvous store at the endpoint; each node says its own rank (torchrun --node-rank)
        config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=rdzv_endpoint,
                              rdzv_backend="static", rdzv_endpoint=rdzv_endpoint, rdzv_configs={"rank": node_rank},
                              max_restarts=0)
    # The launcher logs each failed process at ERROR with its own summary; the process has said why already.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        with stdout_to_stderr():
            elastic_launch(config, sys.executable)("-m", "flashdraft", "train", *train_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise TrainProcessFailed(
            f"train: process {rank} of {nproc * nnodes} exited {failure.exitcode} (its error is above); the others "
            "were stopped. Rerun the same command: it resumes from the newest checkpoint") from None
    except SignalException as e:  # the launcher stopped every process on SIGTERM/SIGINT before raising this
        raise TrainProcessFailed(f"train: stopped by {e.sigval.name}, and its {nproc} processes with it; rerun the "
                                 "same command to resume from the newest checkpoint") from None
    except RendezvousError as e:  # a node that never came, an endpoint nobody listens on or that is taken
        raise TrainProcessFailed(f"train: node {node_rank} of {nnodes} could not meet the others at {rdzv_endpoint}: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
    finally:
        del os.environ[LAUNCHER_PID]
        if not threads_set:
            del os.environ["OMP_NUM_THREADS"]


@contextmanager
def stdout_to_stderr():
    """The processes' log lines go to this process's stderr: its stdout is the command's own (with --json, one
    JSON object). They inherit file descriptor 1, so it points at stderr while they run."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_launched(cfg, data, out, require_checkpoint: bool, log) -> dict:
    """`train.run` with `nproc_per_node` > 1 outside a launcher: the settings as given (CLI overrides and the
    store's push_to included) go to the processes in a config file of their own, and the result is the exported
    drafter's manifest, verified here after they exit."""
    import tempfile
    from pathlib import Path

    import yaml

    from flashdraft.artifact.manifest import require_verified
    from flashdraft.layout import DRAFTER

    where = f" as node {cfg.node_rank} of {cfg.nnodes} (rendezvous at {cfg.rdzv_endpoint})" if cfg.nnodes > 1 else ""
    log(f"train: starting {cfg.nproc_per_node} processes on this node{where} (train.nproc_per_node)")
    with tempfile.TemporaryDirectory(prefix="flashdraft-launch-") as tmp:
        settings = Path(tmp) / "train.yaml"
        settings.write_text(yaml.safe_dump({"train": cfg.model_dump(mode="json", exclude_unset=True)}))
        launch(cfg.nproc_per_node, ["--config", str(settings), "--data", str(data), "--out", str(out)]
               + (["--resume"] if require_checkpoint else []), cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint)
    if cfg.node_rank > 0:  # global rank 0, on node 0, exported the drafter; here it is checked where it was pushed
        return drafter_in_store(cfg, log)
    drafter = Path(out) / DRAFTER
    manifest = require_verified(drafter, "train's drafter", "rerun the same command")
    log(f"train: done, verified — {drafter} (from {cfg.nproc_per_node} processes)")
    return manifest.stats


def drafter_in_store(cfg, log) -> dict:
    """On a node other than node 0: the drafter node 0 exported, verified in the store it was pushed to."""
    from flashdraft.artifact.store import open_store
    from flashdraft.artifact.sync import remote_manifest, verify_store
    from flashdraft.layout import DRAFTER, join

    if not cfg.push_to:
        log(f"train: node {cfg.node_rank}'s processes are done; the drafter is on node 0 (no train.push_to to check "
            "it in)")
        return {}
    where = join(cfg.push_to, DRAFTER)
    store = open_store(where)
    if problems := verify_store(store):
        raise TrainProcessFailed(f"train: node {cfg.node_rank} is done, but the drafter at {where} does not verify: "
                                 f"{problems[0]}")
    log(f"train: done, verified — {where} (node 0's export, checked from node {cfg.node_rank})")
    return remote_manifest(store)[0].stats

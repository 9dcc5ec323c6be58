"""Training processes on one node, started by flashdraft itself: `train.nproc_per_node: N` (N > 1) makes `train`
and `run` launch N copies of `flashdraft train` through torch's own elastic launcher — what `torchrun --standalone
--nproc-per-node N` does, called as a library so that a failed rank ends in one line, not the launcher's traceback.

Each process gets RANK / LOCAL_RANK / WORLD_SIZE as under torchrun and picks its entry of an "a;b" device setting
(train/distributed.py). The rendezvous is on localhost with a free port the launcher picks. Several nodes
(`train.nnodes`): the same command on every node with its `--node-rank`, meeting at node 0's `train.rdzv_endpoint`
(torchrun's static rendezvous), within `train.rdzv_timeout_s`.

While a node waits for the others, torch waits inside C++ (its TCPStore) and Python's signal handlers cannot run:
a stop would wait out the whole timeout. So the wait is watched from a thread (`WaitingForNodes`): it prints where
it waits every few seconds, and a stop signal that arrives before any training process has started ends the node
in one line, at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext

from flashdraft.errors import ExpectedFailure
from flashdraft.guard import LAUNCHER_PID  # set by launch() for its processes, or recorded at their start


class TrainProcessFailed(ExpectedFailure):
    """A training process exited non-zero; it printed its own error above."""


def under_a_launcher() -> bool:
    """This process is one of torchrun's (or flashdraft's own launch): it trains, it does not launch."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


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
    """A training process ends when its launcher dies, even by SIGKILL (which runs no cleanup of the launcher's): the
    kernel sends it SIGTERM (guard.py). flashdraft's own launcher names itself; torchrun is the parent. torchrun starts
    each process in its own session, so a SIGKILLed torchrun (a scheduler's kill, the OOM killer) left them training
    on, and pushing checkpoints to the store beside the node that replaced it."""
    from flashdraft.guard import die_with_parent

    if not under_a_launcher():
        return
    if os.environ.get(LAUNCHER_PID, "").isdigit():  # recorded at the interpreter's start (guard.bind_to_launcher)
        die_with_parent(int(os.environ[LAUNCHER_PID]))
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun running a script of the user's that calls train: its best
        die_with_parent(os.getppid())


WAITING_LINE_EVERY_S = 10.0


class WaitingForNodes:
    """While this node's launcher waits for the others: a line every WAITING_LINE_EVERY_S saying where and for how
    long, and a stop signal (SIGTERM, Ctrl-C) ending the node at once in one line. Python runs a signal's handler
    only between bytecodes, never inside torch's C++ wait; `signal.set_wakeup_fd` has the C-level handler write the
    signal's number to a pipe even then, and a thread reading it acts. Once a training process has started, the
    launcher is back in Python, its own handlers stop the processes, and this stands aside."""

    def __init__(self, node_rank: int, nnodes: int, endpoint: str, timeout_s: int) -> None:
        self.where = (f"node 0 at {endpoint}" if node_rank else f"the other {nnodes - 1} node(s) to join at {endpoint}")
        self.node_rank, self.timeout_s, self.started = node_rank, timeout_s, time.monotonic()
        self.done = threading.Event()

    def __enter__(self) -> WaitingForNodes:
        self.read, self.write = os.pipe()
        os.set_blocking(self.write, False)
        self.previous_fd = signal.set_wakeup_fd(self.write, warn_on_full_buffer=False)
        threading.Thread(target=self.watch_signals, daemon=True).start()
        threading.Thread(target=self.say_where, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        signal.set_wakeup_fd(self.previous_fd)
        os.close(self.write)  # the watcher's read returns empty, and it ends

    def say_where(self) -> None:
        while not self.done.wait(0 if time.monotonic() - self.started < 1 else WAITING_LINE_EVERY_S):
            if training_started():
                return
            waited = time.monotonic() - self.started
            print(f"train: node {self.node_rank} waiting for {self.where} ({waited:.0f} s of {self.timeout_s} s, "
                  "train.rdzv_timeout_s)", file=sys.stderr, flush=True)
            if waited < 1:
                time.sleep(1)

    def watch_signals(self) -> None:
        while True:
            try:
                got = os.read(self.read, 1)
            except OSError:
                return
            if not got or self.done.is_set():
                os.close(self.read)
                return
            number = got[0]
            if number in (signal.SIGTERM, signal.SIGINT) and not training_started():
                print(f"error: train: node {self.node_rank} stopped by {signal.Signals(number).name} while waiting "
                      f"for {self.where}; nothing was trained here", file=sys.stderr, flush=True)
                os._exit(1)  # the main thread is inside torch's C++ wait: nothing there to unwind


def training_started() -> bool:
    """Whether this launcher has started its training processes (they are its children): Linux's
    /proc/self/task/*/children; where that cannot be read, False (the wait is then assumed)."""
    try:
        return any(open(f"/proc/self/task/{task}/children").read().strip() for task in os.listdir("/proc/self/task"))
    except OSError:
        return False


def launch(nproc: int, train_args: list[str], nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, rdzv_timeout_s: int = 600) -> None:
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
                              rdzv_backend="static", rdzv_endpoint=rdzv_endpoint,
                              rdzv_configs={"rank": node_rank, "timeout": rdzv_timeout_s}, max_restarts=0)
    # The launcher logs each failed process at ERROR with its own summary; the process has said why already.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set the wakeup fd
    waiting = WaitingForNodes(node_rank, nnodes, rdzv_endpoint, rdzv_timeout_s) if nnodes > 1 and main_thread else None
    try:
        with stdout_to_stderr(), waiting or nullcontext():
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

    if cfg.nnodes == 1 and not cfg.push_to and not require_checkpoint and (done := already_done(cfg, data, out, log)):
        return done  # a done rerun says so here, without starting processes that would each load torch to say it
    where = f" as node {cfg.node_rank} of {cfg.nnodes} (rendezvous at {cfg.rdzv_endpoint})" if cfg.nnodes > 1 else ""
    log(f"train: starting {cfg.nproc_per_node} processes on this node{where} (train.nproc_per_node)")
    with tempfile.TemporaryDirectory(prefix="flashdraft-launch-") as tmp:
        settings = Path(tmp) / "train.yaml"
        settings.write_text(yaml.safe_dump({"train": cfg.model_dump(mode="json", exclude_unset=True)}))
        launch(cfg.nproc_per_node, ["--config", str(settings), "--data", str(data), "--out", str(out)]
               + (["--resume"] if require_checkpoint else []), cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint,
               cfg.rdzv_timeout_s)
    if cfg.node_rank > 0:  # global rank 0, on node 0, exported the drafter; here it is checked where it was pushed
        return drafter_in_store(cfg, log)
    drafter = Path(out) / DRAFTER
    manifest = require_verified(drafter, "train's drafter", "rerun the same command")
    log(f"train: done, verified — {drafter} (from {cfg.nproc_per_node} processes)")
    return manifest.stats


def already_done(cfg, data, out, log) -> dict | None:
    """The drafter's stats when `out` already holds this run's drafter, verified (the line each process would print,
    printed once here); None when there is work for the processes. On one node and without a store only: with
    several nodes the others wait at the rendezvous for node 0, and with push_to the processes make sure the store
    holds the drafter too."""
    from pathlib import Path

    from flashdraft.artifact.manifest import MANIFEST, check_done, read_manifest
    from flashdraft.layout import DRAFTER
    from flashdraft.model.resolve import resolve_model
    from flashdraft.train.lineage import lineage_of, open_dataset

    drafter = Path(out) / DRAFTER
    if not (drafter / MANIFEST).is_file():
        return None
    lineage = lineage_of(cfg, open_dataset(data).digest, resolve_model(cfg.target, log=log), cfg.nproc_per_node)
    decision = check_done(drafter, lineage)
    if not decision.done:
        return None
    log(decision.line("train", drafter))
    return read_manifest(drafter).stats


def drafter_in_store(cfg, log) -> dict:
    """On a node other than node 0: the drafter node 0 exported, verified in the store it was pushed to."""
    from flashdraft.artifact.store import StoreError, open_store
    from flashdraft.artifact.sync import remote_manifest, verify_store
    from flashdraft.layout import DRAFTER, join

    if not cfg.push_to:
        log(f"train: node {cfg.node_rank}'s processes are done; the drafter is on node 0 (no train.push_to to check "
            "it in)")
        return {}
    where = join(cfg.push_to, DRAFTER)
    store = open_store(where)
    try:
        remote = remote_manifest(store)  # read once: checked, and its stats returned
    except StoreError as e:
        raise TrainProcessFailed(f"train: node {cfg.node_rank} is done, but the drafter at {where} does not verify: "
                                 f"{e}") from None
    if problems := verify_store(store, remote=remote):
        raise TrainProcessFailed(f"train: node {cfg.node_rank} is done, but the drafter at {where} does not verify: "
                                 f"{problems[0]}")
    log(f"train: done, verified — {where} (node 0's export, checked from node {cfg.node_rank})")
    return remote[0].stats

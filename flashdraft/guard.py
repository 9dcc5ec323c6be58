"""A child flashdraft starts never outlives it: the guard between flashdraft and a program it runs (an engine).

    python flashdraft/guard.py PARENT_PID PRIVATE_DIR -- COMMAND ...   # started by served.py, not by hand

The guard leads a process group of its own and starts COMMAND in it; everything COMMAND starts (vLLM's engine-core
and worker processes) stays in that group. The guard stops the whole group — SIGTERM, then SIGKILL after a grace —
when
- flashdraft asks (SIGTERM to the guard: the path of every normal stop, an exception and a stop signal alike);
- flashdraft dies, even by SIGKILL, which runs no code of flashdraft's: the kernel sends the guard SIGTERM when its
  parent dies (PR_SET_PDEATHSIG), and a parent already gone before that was set is seen by its pid;
- COMMAND exits by itself (nothing it started is left behind); the guard then exits with COMMAND's status.

Then it removes PRIVATE_DIR, the directory flashdraft made for the run (the engine's socket): flashdraft removes it
itself on every stop that runs its code, the guard on the one that does not.

It is a file run by path with the Python flashdraft runs on, importing nothing of flashdraft's: it starts in
milliseconds and holds no lock or file of flashdraft's. `die_with_parent()` is the same promise for a process that
is itself flashdraft (a training process the launcher started).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
GRACE_S = 20.0  # vLLM stops its engine core and workers in a few seconds on SIGTERM


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for `sig` when this process's parent dies; if it already has, take `sig` now."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


LAUNCHER_PID = "FLASHDRAFT_LAUNCHER_PID"  # the launcher a training process must not outlive, recorded at its start
TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")  # in torchrun's command line


def launcher_line(launcher: int) -> str:
    return (f"flashdraft: this training process's launcher (pid {launcher}) is gone: stopped before any work "
            "(a process that outlived torchrun would train and push beside the run that replaced it)\n")


def is_torchrun(pid: int) -> bool:
    """Whether process `pid` is torchrun, by its command line (True where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().decode("utf-8", "replace").replace("\0", " ")
    except OSError:
        return not os.path.isdir("/proc")
    return any(name in words for name in TORCHRUN)


def bind_to_launcher(environ=os.environ) -> None:
    """First thing in a training process (`python -m flashdraft`, before its seconds of imports): the launcher it must
    not outlive is fixed now — flashdraft's own names itself in FLASHDRAFT_LAUNCHER_PID; torchrun is the parent this
    process was started by, recorded there — and the kernel is asked for SIGTERM when it dies. One already gone (killed
    while this interpreter started: its parent is now a reaper, not torchrun) ends this process at once, in one line;
    one that dies during the imports ends it with that line too (the command's own handler replaces this one)."""
    if "WORLD_SIZE" not in environ or "LOCAL_RANK" not in environ:
        return
    recorded = environ.get(LAUNCHER_PID, "")
    if recorded.isdigit():
        launcher = int(recorded)
    elif "TORCHELASTIC_RUN_ID" in environ:
        launcher = os.getppid()
        if not is_torchrun(launcher):
            sys.stderr.write(launcher_line(launcher))
            os._exit(1)
        environ[LAUNCHER_PID] = str(launcher)  # what every later check compares with (train/launch.py)
    else:
        return

    def stopped(*_):
        sys.stderr.write(launcher_line(launcher))
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, stopped)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != launcher:  # it died between the read and the request
        sys.stderr.write(launcher_line(launcher))
        os._exit(1)


def group_members(group: int) -> list[int]:
    """The pids of the processes in process group `group`, this one excluded (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # the 5th field of stat is the group
            found.append(int(entry))
    return found


def stop_group(group: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM to every other process of the group, SIGKILL to whatever is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        members = group_members(group)
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        until = time.monotonic() + wait_s
        while members and time.monotonic() < until:
            time.sleep(0.1)
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:  # reap our own child so it is not counted as alive
                    pass
            except ChildProcessError:
                pass
            members = group_members(group)
        if not members:
            return


def main() -> int:
    parent_pid, private, command = int(sys.argv[1]), sys.argv[2], sys.argv[4:]
    assert sys.argv[3] == "--" and command, "guard.py PARENT_PID PRIVATE_DIR -- COMMAND ..."
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    die_with_parent(parent_pid)
    child = subprocess.Popen(command)  # same group as the guard: os.setsid() was done by the guard's own start
    code = None
    while not stopping and code is None:
        try:
            code = child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    stop_group(os.getpgid(0))
    shutil.rmtree(private, ignore_errors=True)
    code = child.poll() if code is None else code
    return 128 + signal.SIGTERM if code is None or stopping else (code if code >= 0 else 128 - code)


if __name__ == "__main__":
    sys.exit(main())

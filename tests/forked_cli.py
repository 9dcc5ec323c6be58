"""The `cli` fixture's fast path: `flashdraft …` in a process forked from one that has already imported what the
commands import (torch, transformers' model classes, flashdraft's stages), as multiprocessing's forkserver does.

Why: a process that trains or evaluates spends ~3.5 s of CPU importing before its first line of work, and the suite
starts hundreds of them on two cores (measured: a quarter of the suite's CPU time went to those imports). The command
itself is unchanged: the real entry point (`python -m flashdraft`, run by runpy as `-m` runs it) in a process of its
own, with the test's argv, environment, working directory, stdin from /dev/null and stdout/stderr on pipes, its exit
code what the interpreter's would be (threads joined, atexit handlers run).

Where a fork could differ from a fresh interpreter, `run` starts a fresh one instead: an environment that differs in
anything read at import time (only FLASHDRAFT_*, AWS_*, PYTEST_* and TORCHINDUCTOR_CACHE_DIR may differ: flashdraft,
boto3 and torch read those when a command runs), or any subprocess option but `check`, `cwd`, `env` and `timeout`.
`FLASHDRAFT_TEST_FORK=0` turns the fast path off for a whole run; `FLASHDRAFT_TEST_FORK_MISSES=FILE` appends to FILE
each test's command that could not fork and the variables that stopped it.

    python tests/forked_cli.py SOCKET PARENT-PID    # the server: imports, then forks one process per request
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RUNTIME_PREFIXES = ("FLASHDRAFT_", "AWS_", "PYTEST_")  # read by a command when it runs, never at import
# torch sets it in the test process the first time it compiles (read again at each use, never at import)
RUNTIME_KEYS = {"TORCHINDUCTOR_CACHE_DIR"}
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "flashdraft.cli",
           "flashdraft.train.stage", "flashdraft.evaluate.stage", "flashdraft.generate.stage",
           "flashdraft.tokenize.stage", "flashdraft.estimate", "flashdraft.pipeline", "flashdraft.artifact.sync",
           "boto3")
READY = b"ready\n"
BASE_ENV = dict(os.environ)  # as this module is first imported (by conftest), before any test changes it
_server: ForkedCli | None = None
_starting = threading.Lock()  # commands run together start the server once


def run_cli(*args: str, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """`python -m flashdraft ARGS` in a process of its own, as a user or a script would run it: forked from this
    process's server where the fork is the same command, else a fresh interpreter (subprocess.run's kwargs)."""
    env = dict(kwargs.get("env") or os.environ)
    proc = None
    if os.environ.get("FLASHDRAFT_TEST_FORK", "1") != "0":
        forked_server()
        if _server.can_run(env, kwargs):
            proc = _server.run(args, env, str(kwargs.get("cwd") or os.getcwd()), kwargs.get("timeout"))
    if proc is None:
        proc = subprocess.run([sys.executable, "-m", "flashdraft", *args], capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"flashdraft {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


# ---------------------------------------------------------------------------------------------- the server


def forked_server() -> ForkedCli:
    """This process's server, started on first use."""
    global _server
    with _starting:
        if _server is None:
            _server = ForkedCli(Path(tempfile.mkdtemp(prefix="flashdraft-cli-")), BASE_ENV)
    return _server


def run_cli_together(*commands: list[str], **kwargs) -> list[subprocess.CompletedProcess]:
    """Each command as `run_cli` runs it, all started at once and run concurrently (a thread waits on each), as
    processes Popen'd together would be: the races the trust tests start. Their results, in the commands' order.
    The server is started here first, in the calling thread: it dies with the thread that started it (the parent
    death signal follows a thread, not a process), and the pool's threads end with this call."""
    from concurrent.futures import ThreadPoolExecutor

    if os.environ.get("FLASHDRAFT_TEST_FORK", "1") != "0":
        forked_server()
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda args: run_cli(*args, **kwargs), commands))


def serve(path: str, parent: int) -> None:
    """Import PRELOAD, then for each connection fork a waiter, which forks the command, reports its pid, waits for
    it and reports its exit code. The server itself never runs a command, so each fork starts from the same state."""
    import importlib

    from flashdraft.cli.app import quiet_library_progress_bars
    from flashdraft.guard import die_with_parent

    die_with_parent(parent)  # a pytest worker killed outright leaves no server behind (its forks are not affected)

    # Every request's stderr is a pipe, so every command turns the libraries' bars off before importing them; the
    # libraries read that when imported, so it is done here, before they are (the command does it again: a no-op).
    quiet_library_progress_bars()
    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, "a thread at fork time would be missing in every command"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    while True:
        conn, _ = server.accept()
        while True:  # reap the waiters that are done
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if os.fork() == 0:
            server.close()
            wait_for_one(conn)  # never returns
        conn.close()


def wait_for_one(conn: socket.socket) -> None:
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            conn.close()
            run_command(request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)


def run_command(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m flashdraft ARGS` with the request's stdio, directory and environment,
    and end as that interpreter would."""
    import runpy
    import traceback

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [str(Path(sys.modules["flashdraft"].__file__).parent / "__main__.py"), *request["args"]]
        sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
        try:
            runpy.run_module("flashdraft", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:  # sys.exit(n), sys.exit("message"), sys.exit(None): as the interpreter treats them
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 — what the interpreter does with an uncaught exception
            traceback.print_exc()
        threading._shutdown()  # non-daemon threads are joined, as at a normal exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 — a closed pipe: nothing left to say
                pass
        os._exit(code)


# ---------------------------------------------------------------------------------------------- the client


class ForkedCli:
    """One server per pytest process (per xdist worker), started on first use, stopped at exit."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.socket = str(root / "cli.sock")
        self.log = root / "server.log"
        self.env = env
        self.process = subprocess.Popen([sys.executable, __file__, self.socket, str(os.getpid())],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log.open("wb"),
                                        env=self.env)
        if self.process.stdout.readline() != READY:
            self.process.kill()
            raise RuntimeError(f"the forked-CLI server did not start (its log: {self.log}): "
                               f"{self.log.read_text()[-2000:]}")
        atexit.register(self.stop, root)

    def stop(self, root: Path) -> None:
        import shutil

        self.process.kill()
        self.process.wait()
        shutil.rmtree(root, ignore_errors=True)  # the socket and the server's log, made by mkdtemp for it alone

    def can_run(self, env: dict[str, str], kwargs: dict) -> bool:
        if set(kwargs) - {"cwd", "env", "timeout"} or self.process.poll() is not None:
            return False
        differ = {key for key in env.keys() | self.env.keys() if env.get(key) != self.env.get(key)}
        read_at_import = sorted(k for k in differ if not k.startswith(RUNTIME_PREFIXES) and k not in RUNTIME_KEYS)
        if read_at_import and os.environ.get("FLASHDRAFT_TEST_FORK_MISSES"):  # where the fast path was lost, and why
            with open(os.environ["FLASHDRAFT_TEST_FORK_MISSES"], "a") as f:
                f.write(f"{os.environ.get('PYTEST_CURRENT_TEST')}: {' '.join(read_at_import)}\n")
        return not read_at_import

    def run(self, args: tuple[str, ...], env: dict[str, str], cwd: str, timeout: float | None
            ) -> subprocess.CompletedProcess:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        try:
            request = {"args": list(args), "env": env, "cwd": cwd}
            socket.send_fds(conn, [json.dumps(request).encode()], [devnull, out_w, err_w])
        finally:
            for fd in (devnull, out_w, err_w):
                os.close(fd)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}

        def drain(fd: int) -> None:
            with os.fdopen(fd, "rb") as pipe:
                while data := pipe.read1(1 << 16):
                    chunks[fd].append(data)

        readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_r, err_r)]
        for reader in readers:
            reader.start()
        answers = conn.makefile("rb")
        pid = json.loads(answers.readline())["pid"]
        deadline = None if timeout is None else time.monotonic() + timeout
        conn.settimeout(None if timeout is None else max(0.0, deadline - time.monotonic()))
        try:
            returncode = json.loads(answers.readline())["returncode"]
        except TimeoutError:
            os.kill(pid, 9)
            raise subprocess.TimeoutExpired([sys.executable, "-m", "flashdraft", *args], timeout) from None
        finally:
            conn.close()
        for reader in readers:
            reader.join()
        return subprocess.CompletedProcess([sys.executable, "-m", "flashdraft", *args], returncode,
                                           text(b"".join(chunks[out_r])), text(b"".join(chunks[err_r])))


def text(data: bytes) -> str:
    """As subprocess.run(text=True) decodes: the locale's encoding, universal newlines."""
    import io
    import locale

    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False)).read()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))

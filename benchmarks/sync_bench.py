"""sync benchmark: flashdraft vs s5cmd vs rclone vs aws s3 sync, same machine, same SeaweedFS, same data.

    .venv/bin/python benchmarks/sync_bench.py [--total-mb 1024] [--files 40] [--small-files 1000]

Measures, per tool: full upload time, no-op re-sync time and request bytes sent (counted by a loopback
forwarder in front of the server), whether a same-size edit with an older mtime reaches the store; the no-op
re-sync of 1,000 small files; and local hashing GB/s (SHA-256 + CRC64NVME, one core and all cores).
Peers run with their default settings. awscli lives in its own venv (.bench/awscli; it pins botocore),
created on first run. Results are appended to benchmarks/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".bench"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from flashdraft.artifact.manifest import build_manifest, digest_files, write_manifest  # noqa: E402
from tests.servers import TcpForwarder, seaweed_server  # noqa: E402


def aws_cli() -> str:
    venv = BENCH / "awscli"
    if not (venv / "bin" / "aws").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "awscli"], check=True)
    return str(venv / "bin" / "aws")


def make_data(root: Path, total_mb: int, files: int, equal: bool = False) -> list[Path]:
    """`files` files from 1 MB up to 64 MB, about `total_mb` in all (random bytes: nothing compresses); or,
    `equal`, `files` shards of one size (a tokenize output's layout: the seeds' 47 shards in miniature)."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    weights = [1 + 63 * (i / max(1, files - 1)) ** 2 for i in range(files)]
    scale = total_mb / sum(weights)
    paths = []
    for i, w in enumerate(weights):
        size = (total_mb << 20) // files if equal else max(1, min(64, round(w * scale))) << 20
        path = root / f"shard-{i:03d}.bin"
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        paths.append(path)
    write_manifest(root, build_manifest(root, kind="files"))  # stage artifacts always carry one
    return paths


def make_small(root: Path, count: int) -> None:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for i in range(count):
        (root / f"rec-{i:05d}.json").write_bytes(os.urandom(4096))
    write_manifest(root, build_manifest(root, kind="files"))


def commands(tool: str, src: Path, bucket: str, prefix: str, endpoint: str) -> list[str]:
    dest = f"s3://{bucket}/{prefix}"
    if tool == "flashdraft":
        return [str(BIN / "flashdraft"), "sync", "push", str(src), dest, "--endpoint-url", endpoint]
    if tool == "s5cmd":
        return [str(BIN / "s5cmd"), "--endpoint-url", endpoint, "sync", f"{src}/", f"{dest}/"]
    if tool == "rclone":
        return [str(BIN / "rclone"), "sync", str(src), f":s3:{bucket}/{prefix}", "--s3-endpoint", endpoint]
    if tool == "aws s3 sync":
        return [aws_cli(), "--endpoint-url", endpoint, "s3", "sync", str(src), dest, "--only-show-errors"]
    raise ValueError(tool)


def timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed: {proc.stderr[-800:]}")
    return elapsed


def remote_sha256(server, key: str) -> str:
    body = server.client().get_object(Bucket=server.bucket, Key=key)["Body"].read()
    return hashlib.sha256(body).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--small-files", type=int, default=1000)
    ap.add_argument("--equal", action="store_true", help="files of one size (a dataset's shards), not 1-64 MB")
    ap.add_argument("--tools", default="flashdraft,s5cmd,rclone,aws s3 sync")
    ap.add_argument("--no-record", action="store_true", help="Do not append to benchmarks/RESULTS.md.")
    args = ap.parse_args()
    tools = args.tools.split(",")

    data, small = BENCH / "sync-data", BENCH / "sync-small"
    print(f"making {args.files} files, ~{args.total_mb} MB, and {args.small_files} small files …", flush=True)
    paths = make_data(data, args.total_mb, args.files, args.equal)
    make_small(small, args.small_files)
    total_bytes = sum(p.stat().st_size for p in paths)

    # Local hashing (what every push does first): one core, then all cores.
    start = time.perf_counter()
    digest_files(paths, jobs=1)
    one_core = total_bytes / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    digest_files(paths)
    all_cores = total_bytes / (time.perf_counter() - start) / 1e9

    rows = []
    shutil.rmtree(BENCH / "seaweed", ignore_errors=True)  # every tool starts from an empty store
    with seaweed_server(BENCH / "seaweed") as server:
        env = dict(
            os.environ,
            AWS_ACCESS_KEY_ID=server.access_key,
            AWS_SECRET_ACCESS_KEY=server.secret_key,
            AWS_REGION="us-east-1",
            AWS_DEFAULT_REGION="us-east-1",
            RCLONE_S3_PROVIDER="Other",
            RCLONE_S3_ACCESS_KEY_ID=server.access_key,
            RCLONE_S3_SECRET_ACCESS_KEY=server.secret_key,
            RCLONE_S3_REGION="us-east-1",
            RCLONE_CONFIG="/dev/null",
        )
        port = int(server.endpoint.rsplit(":", 1)[1])
        for tool in tools:
            slug = tool.replace(" ", "-")
            print(f"{tool}: full upload …", flush=True)
            full = timed(commands(tool, data, server.bucket, f"{slug}/big", server.endpoint), env)
            counter = TcpForwarder(port)
            proxied = f"http://127.0.0.1:{counter.port}"
            noop = timed(commands(tool, data, server.bucket, f"{slug}/big", proxied), env)
            noop_bytes = counter.bytes_up
            counter.close()

            timed(commands(tool, small, server.bucket, f"{slug}/small", server.endpoint), env)
            noop_small = timed(commands(tool, small, server.bucket, f"{slug}/small", server.endpoint), env)

            # Same-size edit with an older mtime, on a private copy of one file.
            edit_dir = BENCH / f"edit-{slug}"
            shutil.rmtree(edit_dir, ignore_errors=True)
            edit_dir.mkdir()
            victim = edit_dir / "x.bin"
            victim.write_bytes(os.urandom(1 << 20))
            timed(commands(tool, edit_dir, server.bucket, f"{slug}/edit", server.endpoint), env)
            old = victim.stat().st_mtime
            blob = bytearray(victim.read_bytes())
            blob[4096] ^= 0xFF
            victim.write_bytes(bytes(blob))
            os.utime(victim, (old - 3600, old - 3600))
            timed(commands(tool, edit_dir, server.bucket, f"{slug}/edit", server.endpoint), env)
            caught = remote_sha256(server, f"{slug}/edit/x.bin") == hashlib.sha256(blob).hexdigest()

            rows.append((tool, full, noop, noop_bytes, noop_small, caught))
            print(f"  full {full:.2f}s  no-op {noop:.2f}s ({noop_bytes:,} B)  no-op×{args.small_files} "
                  f"{noop_small:.2f}s  edit caught: {caught}", flush=True)

    base = {r[0]: r for r in rows}.get("s5cmd")
    aws = {r[0]: r for r in rows}.get("aws s3 sync")
    lines = [
        f"### sync — {datetime.now(UTC).date()} — {len(paths)} files, {total_bytes / 1e9:.2f} GB, "
        f"{args.small_files} small files, SeaweedFS on 127.0.0.1, {os.cpu_count()} cores",
        "",
        f"Command: `.venv/bin/python benchmarks/sync_bench.py --total-mb {args.total_mb} --files {args.files} "
        f"--small-files {args.small_files}{' --equal' if args.equal else ''}`",
        "",
        "| tool | full upload s | ratio vs s5cmd | ratio vs aws | MB/s | no-op re-sync s | no-op request bytes | "
        f"no-op × {args.small_files} files s | same-size edit (older mtime) sent |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tool, full, noop, noop_bytes, noop_small, caught in rows:
        ratio = f"{full / base[1]:.2f}" if base else "—"
        vs_aws = f"{full / aws[1]:.2f}" if aws else "—"
        lines.append(
            f"| {tool} | {full:.2f} | {ratio} | {vs_aws} | {total_bytes / full / 1e6:.0f} | {noop:.2f} | "
            f"{noop_bytes:,} | {noop_small:.2f} | {'yes' if caught else '**no**'} |"
        )
    lines += [
        "",
        f"Local hashing (SHA-256 + CRC64NVME in one pass): {one_core:.2f} GB/s on one core, "
        f"{all_cores:.2f} GB/s on all {os.cpu_count()} cores.",
        "",
    ]
    report = "\n".join(lines)
    print("\n" + report)
    if not args.no_record:
        results = ROOT / "benchmarks" / "RESULTS.md"
        existing = results.read_text() if results.exists() else "# Benchmark results\n\n"
        results.write_text(existing.rstrip() + "\n\n" + report)


if __name__ == "__main__":
    main()

"""scale benchmark: flashdraft's own cost per stage at three dataset sizes, and what it projects to at the
reference run's 902K samples.

    .venv/bin/python benchmarks/scale_bench.py [--sizes 10000,30000,90000] [--work DIR] [--no-record]

Seed-shaped synthetic conversations (a ~250-token prompt, a ~1,700-token answer that reasons then answers;
deterministic) go through every stage as its own `flashdraft` process: generate (openai backend against a
local endpoint that answers at once, so the time is flashdraft's own), tokenize, verify, `sync push` to
SeaweedFS, status (local and store), train start-up to the first optimizer step (the embedded SmolLM2 target,
online features; the time until metrics.jsonl holds step 1), and `estimate`. For each stage and size: wall
time and peak RSS (the sum over the stage's process tree, sampled every 50 ms); then the growth exponent a
(time ∝ N^a, between the smallest and largest size), the RSS change between them, and the projection to 902,087
samples. Goals (issue 33): RSS flat in N (within 10 %), time linear or better, train start-up within 10 %
between the smallest and largest size. Appended to benchmarks/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from record import record  # noqa: E402  (benchmarks/record.py, beside this script)

SEEDS_SAMPLES = 902_087
WORDS = ("the model reads each token and keeps a state of what came before so that the next step can use it "
         "when a block of drafts is proposed the target checks all of them at once and keeps the longest run "
         "it agrees with then the loop starts again after the accepted prefix with one bonus token from the "
         "target itself which is why a drafter that is right about the first few positions matters most "
         "numbers like 17 and 2048 appear in code and in prose alike as do names such as Alice Berlin or Kyoto "
         "functions return values errors are raised tests pass and fail caches warm up and disks fill").split()


def words(seed: int, count: int) -> str:
    """`count` words picked deterministically from `seed` (a hash stream, not Python's per-process random)."""
    out, block = [], b""
    for i in range(count):
        if i % 16 == 0:
            block = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=16).digest()
        out.append(WORDS[block[i % 16] % len(WORDS)])
    return " ".join(out)


def prompts(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": words(i, 235)}]}) + "\n")


# ------------------------------------------------------------------------------------------- the endpoint

# 64 canned answers, picked by the prompt's hash: an endpoint that answers at once, so generate's time is its own.
# (--answer-words shortens them: the test of this script runs every stage on answers of 200 words.)
ANSWER_WORDS = 1_700


def answers(total_words: int) -> list[str]:
    thought = total_words * 920 // 1_700
    return [f"Let me think this through. {words(10_000 + k, thought)}\n\nSo the answer: "
            f"{words(20_000 + k, total_words - thought)}" for k in range(64)]


ANSWERS = answers(ANSWER_WORDS)


class Endpoint(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._send({"object": "list", "data": [{"id": "synthetic", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = request["messages"][-1]["content"]
        answer = ANSWERS[int(hashlib.blake2b(text.encode(), digest_size=2).hexdigest(), 16) % len(ANSWERS)]
        self._send({"id": "c", "object": "chat.completion", "created": 0, "model": "synthetic",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": answer}}],
                    "usage": {"prompt_tokens": 250, "completion_tokens": len(answer.split()),
                              "total_tokens": 250 + len(answer.split())}})

    def log_message(self, *args) -> None:
        pass


def serve(port_file: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    server.daemon_threads = True
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()


# ------------------------------------------------------------------------------------------- measuring


def measure(cmd: list[str], env: dict, first_step: Path | None = None) -> dict:
    """Run one stage; its wall time, peak RSS over its process tree, and (train) when step 1 was logged."""
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, stepped = 0, None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        if first_step is not None and stepped is None and first_step.is_file() and first_step.stat().st_size:
            stepped = time.perf_counter() - start
        time.sleep(0.05)
    out = proc.stdout.read()
    reader.join()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{''.join(lines)[-3000:]}")
    result = {"seconds": round(seconds, 2), "peak_rss_mb": round(peak / 2**20)}
    if first_step is not None:
        result["to_first_step_s"] = round(stepped if stepped is not None else seconds, 2)
    try:
        result["json"] = json.loads(out)
    except json.JSONDecodeError:
        pass
    return result


def pipeline_config(work: Path, url: str) -> Path:
    path = work / "pipeline.yaml"
    path.write_text(f"""workdir: {work}
generate:
  prompts: {work / 'prompts.jsonl'}
  backend: openai
  model: synthetic
  base_urls: [{url}]
  max_new_tokens: 4096
  batch_size: 2000
  concurrency: 64
tokenize:
  tokenizer: embedded
  max_length: 4096
  block_size: 4
train:
  target: embedded
  num_layers: 1
  block_size: 4
  max_anchors: 8
  batch_size: 1
  max_steps: 1
  eval_samples: 2
  max_length: 4096
  checkpoint_every: 1000
""")
    return path


STAGES = ("generate", "tokenize", "verify", "sync push", "status", "train start-up", "estimate")


def one_size(n: int, work: Path, url: str, store: str, env: dict, only: tuple[str, ...] = STAGES) -> dict:
    shutil.rmtree(work, ignore_errors=True)  # every stage measured building, not as an "already done" rerun
    work.mkdir(parents=True)
    prompts(work / "prompts.jsonl", n)
    cfg = pipeline_config(work, url)
    fd = [sys.executable, "-m", "flashdraft"]
    commands = {
        "generate": [*fd, "generate", "--config", str(cfg), "--out", str(work / "generate"), "--json"],
        "tokenize": [*fd, "tokenize", "--config", str(cfg), "--input", str(work / "generate"), "--out",
                     str(work / "dataset"), "--json"],
        "verify": [*fd, "verify", str(work / "dataset")],
        "sync push": [*fd, "sync", "push", str(work / "dataset"), f"{store}/dataset"],
        "status": [*fd, "status", "--config", str(cfg), "--store", store],
        "train start-up": [*fd, "train", "--config", str(cfg), "--data", str(work / "dataset"), "--out",
                           str(work / "train")],
        "estimate": [*fd, "estimate", str(cfg), "--json"],
    }
    stages = {}
    for stage in STAGES:  # each needs only the stages before it (generate and estimate need none)
        if stage in only:
            first_step = work / "train" / "metrics.jsonl" if stage == "train start-up" else None
            stages[stage] = measure(commands[stage], env, first_step=first_step)
    tokens = stages.get("tokenize", {}).get("json", {}).get("tokens")
    return {"samples": n, "tokens": tokens, "stages": stages}


def growth(small: dict, large: dict, key: str) -> float:
    a, b = small[key], large[key]
    return math.log(b / a) / math.log(large["n"] / small["n"]) if a > 0 and b > 0 else float("nan")


def report(runs: list[dict], command: str) -> list[str]:
    first, last = runs[0], runs[-1]
    sizes = " / ".join(f"{r['samples']:,}" for r in runs)
    lines = [f"## scale: every stage at {sizes} samples ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)", "",
             f"`{command}`", "",
             "Seed-shaped synthetic conversations" + ("" if not first["tokens"] else ", " + ", ".join(
                 f"{r['samples']:,} = {r['tokens'] / 1e6:.1f}M tokens" for r in runs if r["tokens"])
                 + f" ({first['tokens'] / first['samples']:,.0f} a sample; the seeds': ~2,070)") + ". "
             f"Time ∝ N^a between {first['samples']:,} and {last['samples']:,}; RSS change = peak RSS at the "
             "largest size ÷ at the smallest; projection to the reference run's 902,087 samples.", "",
             "| stage | " + " | ".join(f"s @ {r['samples']:,}" for r in runs) + " | a | "
             + " | ".join(f"MB @ {r['samples']:,}" for r in runs) + " | RSS change | projected s @ 902K |",
             "|---|" + "---:|" * (2 * len(runs) + 3)]
    for stage in first["stages"]:
        key = "to_first_step_s" if stage == "train start-up" else "seconds"
        times = [r["stages"][stage][key] for r in runs]
        rss = [r["stages"][stage]["peak_rss_mb"] for r in runs]
        a = growth({"n": first["samples"], "v": times[0]}, {"n": last["samples"], "v": times[-1]}, "v") \
            if len(runs) > 1 else float("nan")
        projected = times[-1] * (SEEDS_SAMPLES / last["samples"]) ** max(a, 0.0) if not math.isnan(a) else None
        lines.append(f"| {stage} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {a:.2f} | "
                     + " | ".join(f"{m:,}" for m in rss) + f" | {rss[-1] / max(rss[0], 1):.2f}× | "
                     + (f"{projected:,.0f}" if projected is not None else "–") + " |")
    return lines


WORK_MARKER = ".flashdraft-scale-bench"  # in --work: this benchmark made it, so it may clear what is inside


def claim_work(work: Path) -> None:
    """The benchmark deletes and rebuilds its own subdirectories of `work` on every run: only in a directory
    it made (or an empty one), never in one that holds anything else."""
    if work.exists() and any(work.iterdir()) and not (work / WORK_MARKER).is_file():
        raise SystemExit(f"{work} holds files this benchmark did not make; pass an empty or new --work")
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARKER).touch()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,30000,90000")
    ap.add_argument("--work", type=Path, default=Path("/tmp/flashdraft-scale"))
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="which stages to measure; each needs the ones before it, except generate and estimate")
    ap.add_argument("--json", type=Path, help="also write the raw measurements here")
    ap.add_argument("--answer-words", type=int, default=ANSWER_WORDS,
                    help="the endpoint's answers' length in words (the reference run's: ~1,700 tokens)")
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # internal: run the endpoint
    args = ap.parse_args()
    if args.serve:
        global ANSWERS
        ANSWERS = answers(args.answer_words)
        serve(args.serve)
        return
    from tests.servers import seaweed_server

    sizes = [int(s) for s in args.sizes.split(",")]
    claim_work(args.work)
    port_file = args.work / "endpoint.port"
    port_file.unlink(missing_ok=True)
    endpoint = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file), "--answer-words",
                                 str(args.answer_words)])
    try:
        while not port_file.exists():
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}/v1"
        shutil.rmtree(args.work / "seaweed", ignore_errors=True)  # a fresh store: every push builds
        with seaweed_server(args.work / "seaweed") as s3:
            env = dict(os.environ, AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key,
                       AWS_ENDPOINT_URL=s3.endpoint, AWS_REGION="us-east-1", OPENAI_API_KEY="EMPTY",
                       HF_HUB_OFFLINE="1")
            runs = []
            for n in sizes:
                runs.append(one_size(n, args.work / f"n{n}", url, f"s3://{s3.bucket}/scale/n{n}", env,
                                     tuple(args.stages.split(","))))
                print(json.dumps({"samples": n, **{k: {m: v for m, v in s.items() if m != "json"}
                                                   for k, s in runs[-1]["stages"].items()}}), flush=True)
    finally:
        endpoint.terminate()
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    command = "benchmarks/scale_bench.py " + " ".join(sys.argv[1:])
    record(report(runs, command.strip()), keep=not args.no_record)


if __name__ == "__main__":
    main()

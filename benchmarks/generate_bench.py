"""generate benchmark: the hf backend through the whole stage vs a bare `model.generate` loop, on SmolLM2.

    .venv/bin/python benchmarks/generate_bench.py [--prompts 32] [--max-new-tokens 48] [--batches 1,8,32]
        [--dtype float32|bfloat16]

Each variant runs in its own process (so peak RSS is its own) on the same built-in demo prompts, greedy,
same token budget; both times include importing torch/transformers and loading the model from the cached
HF directory. flashdraft's time
also covers everything the stage does (prompt loading, atomic batch files, manifest). Ratio =
flashdraft tokens/s ÷ bare tokens/s (target ≥ 0.9). Results are appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from record import record  # benchmarks/record.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def bare(prompts_path: str, batch: int, max_new_tokens: int, dtype: str) -> dict:
    """What a hand-written script does: chat template, left-padded batches, model.generate, count tokens."""
    from flashdraft.model.resolve import resolve_model

    path = resolve_model("embedded", log=lambda s: None)  # conversion is cached before either variant is timed
    start = time.perf_counter()  # both variants pay for importing torch and transformers
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    messages = [json.loads(line)["messages"] for line in Path(prompts_path).read_text().splitlines()]
    tokens = 0
    for i in range(0, len(messages), batch):
        texts = [
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages[i : i + batch]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            stop = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            tokens += stop
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def flashdraft(prompts_path: str, batch: int, max_new_tokens: int, dtype: str) -> dict:
    from flashdraft import generate
    from flashdraft.config import GenerateConfig
    from flashdraft.model.resolve import resolve_model

    resolve_model("embedded", log=lambda s: None)  # conversion is cached before either variant is timed
    cfg = GenerateConfig(prompts=prompts_path, batch_size=batch, max_new_tokens=max_new_tokens, dtype=dtype)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        stats = generate.run(cfg, Path(out) / "gen", log=lambda s: None)
        return {"tokens": stats["completion_tokens"], "seconds": time.perf_counter() - start}


def worker(args: argparse.Namespace) -> None:
    fn = {"bare": bare, "flashdraft": flashdraft}[args.worker]
    result = fn(args.prompts_file, args.batch, args.max_new_tokens, args.dtype)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=2, help="Runs per variant, interleaved; the best is kept.")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="The target's weights in both variants (generate.dtype).")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--worker", choices=["bare", "flashdraft"], help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from flashdraft.generate.prompts import load_prompts
    from flashdraft.model.resolve import resolve_model

    resolve_model("embedded")
    prompts = load_prompts("builtin:demo").prompts[:: max(1, 404 // args.prompts)][: args.prompts]
    prompts_file = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"messages": p.messages}) + "\n" for p in prompts))

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        result: dict[str, dict] = {}
        for _ in range(args.repeats):  # interleaved, best kept: two shared cores are noisy (±10 % run to run)
            for variant in ("bare", "flashdraft"):
                cmd = [sys.executable, __file__, "--worker", variant, "--prompts-file", str(prompts_file),
                       "--batch", str(batch), "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
                run = json.loads(proc.stdout.strip().splitlines()[-1])
                if variant not in result or run["seconds"] < result[variant]["seconds"]:
                    result[variant] = run
        tps = {v: r["tokens"] / r["seconds"] for v, r in result.items()}
        rows.append((batch, tps["bare"], tps["flashdraft"], result["bare"], result["flashdraft"]))
        print(f"batch {batch}: bare {tps['bare']:.1f} tok/s, flashdraft {tps['flashdraft']:.1f} tok/s, "
              f"ratio {tps['flashdraft'] / tps['bare']:.2f}", flush=True)

    lines = [
        f"### generate (hf backend) — {datetime.now(UTC).date()} — SmolLM2-135M-Instruct, CPU, "
        f"{os.cpu_count()} cores, {args.prompts} prompts, {args.max_new_tokens} new tokens, greedy, {args.dtype}",
        "",
        f"Command: `.venv/bin/python benchmarks/generate_bench.py --prompts {args.prompts} "
        f"--max-new-tokens {args.max_new_tokens} --batches {args.batches} --repeats {args.repeats} "
        f"--dtype {args.dtype}` "
        "(best of the repeats; times include imports and model load)",
        "",
        "| batch | bare generate tok/s | flashdraft tok/s | ratio | bare peak RSS MB | flashdraft peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for batch, bare_tps, fd_tps, bare_r, fd_r in rows:
        lines.append(
            f"| {batch} | {bare_tps:.1f} | {fd_tps:.1f} | {fd_tps / bare_tps:.2f} | {bare_r['peak_rss_mb']:.0f} | "
            f"{fd_r['peak_rss_mb']:.0f} |"
        )
    record(lines, keep=not args.no_record)


if __name__ == "__main__":
    main()

"""eval benchmark: τ and speedup of the demo drafter on SmolLM2, next to prompt-lookup decoding.

    .venv/bin/flashdraft demo                       # trains the demo drafter into flashdraft-work/
    .venv/bin/python benchmarks/eval_bench.py [--drafter flashdraft-work/train/drafter] [--prompts 50]

Runs `flashdraft eval` on the first N held-out prompts (`builtin:chat-heldout`, eval's default: hand-written,
never trained on), greedy, 64 new tokens: speculative decoding, target-only decoding and prompt lookup, timed
interleaved per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from record import record  # benchmarks/record.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="flashdraft-work/train/drafter")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    from flashdraft.config import EvalConfig
    from flashdraft.evaluate import run

    cfg = EvalConfig(max_prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as out:
        run(cfg, Path(args.drafter), Path(out) / "eval")
        report = json.loads((Path(out) / "eval" / "report.json").read_text())
    drafter_stats = json.loads((Path(args.drafter) / "manifest.json").read_text())["stats"]
    prompts = report["prompts"]  # per-prompt results
    n_prompts = len(prompts) if isinstance(prompts, list) else prompts
    lines = [
        f"### eval — {datetime.now(UTC).date()} — SmolLM2-135M-Instruct target, demo drafter "
        f"({drafter_stats.get('steps')} steps), {n_prompts} held-out prompts, {args.max_new_tokens} new "
        f"tokens, greedy, CPU, {os.cpu_count()} cores",
        "",
        f"Command: `.venv/bin/flashdraft demo && .venv/bin/python benchmarks/eval_bench.py --prompts {args.prompts} "
        f"--max-new-tokens {args.max_new_tokens}`",
        "",
        "| method | τ (tokens per target pass) | speedup vs target-only | lossless |",
        "| --- | --- | --- | --- |",
        f"| DFlash drafter | {report['acceptance_length']:.2f} | {report['speedup']:.2f}× | {report['lossless']} |",
        f"| prompt lookup (10 tokens) | {report['lookup_acceptance_length']:.2f} | "
        f"{report['lookup_speedup']:.2f}× | — |",
        "",
        f"Acceptance by block position: {report['acceptance_by_position'][:6]} …; target-only "
        f"{report['target_tokens_per_s']:.1f} tok/s, speculative {report['tokens_per_s']:.1f} tok/s.",
    ]
    for name, block in report.get("by_category", {}).items():
        lines.append(f"- {name}: τ {block['acceptance_length']:.2f}, speedup {block['speedup']:.2f}×")
    record(lines, keep=not args.no_record)


if __name__ == "__main__":
    main()

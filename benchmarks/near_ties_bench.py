"""How far apart greedy speculative output and target-only output are where they first differ, in units in the last
place of the target's top logit: what `eval.near_tie_ulps` must allow on this machine, and what a decoding bug
looks like next to it.

    .venv/bin/python benchmarks/near_ties_bench.py --drafter flashdraft-work/train/drafter --dtype bfloat16
    .venv/bin/python benchmarks/near_ties_bench.py --drafter flashdraft-work/train/drafter --dtype bfloat16 --fault

It runs `flashdraft eval` (in this process, so that `--fault` can break its decoder) with every difference
recorded (`near_tie_ulps: 0`) and counts, per prompt, how far the farther of the two tokens at the first
difference is behind the top logit. `--fault` leaves the verify pass's rejected drafts in the target's cache (no
crop, a real decoding bug) to show what the check must still catch. On a GPU, run it once with the engine's
dtype before trusting the default tolerance (2 units): kernels there may round further apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from record import record  # benchmarks/record.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--prompts", default="builtin:chat-heldout")
    ap.add_argument("--max-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--fault", action="store_true", help="keep rejected drafts in the target's cache")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from flashdraft.config import EvalConfig
    from flashdraft.evaluate import run
    from flashdraft.evaluate.decode import TargetCache

    if args.fault:
        TargetCache.keep = lambda self, block, accepted, snapshot, advance: None
    cfg = EvalConfig(prompts=args.prompts, max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
                     target_dtype=args.dtype, near_tie_ulps=0)
    with tempfile.TemporaryDirectory() as out:
        run(cfg, args.drafter, Path(out) / "eval", log=lambda s: None)
        prompts = json.loads((Path(out) / "eval" / "report.json").read_text())["prompts"]
    # per diverged prompt: the farther of the two tokens behind the top logit, in units in the last place
    apart = [max(p["divergence"].get("ulps_behind_top", [float("inf")])) for p in prompts if p["divergence"]]
    histogram = Counter("0–1" if u <= 1 else "2" if u <= 2 else "3–5" if u <= 5 else "≥ 6" for u in apart)
    decoder_kind = "rejected drafts left in the cache (fault)" if args.fault else "flashdraft's"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [
        f"### near ties — {datetime.now(UTC):%Y-%m-%d} — {args.dtype} target, {device}, {decoder_kind} decoder",
        "",
        f"Command: `.venv/bin/python benchmarks/near_ties_bench.py --drafter {args.drafter} --dtype {args.dtype}"
        f"{' --fault' if args.fault else ''}` ({len(prompts)} prompts of {args.prompts}, "
        f"{args.max_new_tokens} new tokens, greedy)",
        "",
        "| prompts | token for token | differ | 0–1 units apart | 2 | 3–5 | ≥ 6 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {len(prompts)} | {len(prompts) - len(apart)} | {len(apart)} | {histogram['0–1']} | {histogram['2']} | "
        f"{histogram['3–5']} | {histogram['≥ 6']} |",
    ]
    record(lines, keep=not args.no_record)


if __name__ == "__main__":
    main()

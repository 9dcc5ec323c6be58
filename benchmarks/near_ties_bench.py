"""How far apart greedy speculative output and target-only output are where they first differ, in units in the last
place of the target's top logit: what `eval.near_tie_ulps` must allow on this machine, and what a decoding bug
looks like next to it.

    .venv/bin/python benchmarks/near_ties_bench.py --drafter flashdraft-work/train/drafter --dtype bfloat16
    .venv/bin/python benchmarks/near_ties_bench.py --drafter flashdraft-work/train/drafter --dtype bfloat16 --fault

Each prompt is decoded by `SpecDecoder` and by target-only greedy decoding (what `flashdraft eval` does) and
`divergence` measures their first difference. `--fault` leaves the verify pass's rejected drafts in the target's
cache (no crop, a real decoding bug) to show what the check must still catch. On a GPU, run it once with the
engine's dtype before trusting the default tolerance (2 units): kernels there may round further apart.
"""

from __future__ import annotations

import argparse
import sys
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
    from transformers import AutoTokenizer

    from flashdraft.evaluate.decode import SpecDecoder, TargetCache, divergence, target_only
    from flashdraft.generate.prompts import load_prompts
    from flashdraft.model.export import load_drafter
    from flashdraft.model.resolve import resolve_model, stop_token_ids
    from flashdraft.model.target import Target

    if args.fault:
        TargetCache.keep = lambda self, block, accepted, snapshot, advance: None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = resolve_model("embedded", log=lambda s: None)
    target = Target(path, device, lambda s: None, args.dtype)
    drafter = load_drafter(args.drafter, device=device, dtype=target.model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    decoder = SpecDecoder(target, drafter, stop_token_ids(tokenizer, target.model.generation_config.eos_token_id))
    apart = []  # per diverged prompt: the farther of the two tokens behind the top logit, in units
    prompts = load_prompts(args.prompts).prompts[: args.max_prompts]
    for prompt in prompts:
        ids = list(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
        spec = decoder.generate(ids, args.max_new_tokens)
        base, _, _ = target_only(target, ids, args.max_new_tokens)
        found = divergence(target, ids, base, spec.tokens, tie_ulps=0)
        if found is not None:
            apart.append(max(found.get("ulps_behind_top", [float("inf")])))
    histogram = Counter("0–1" if u <= 1 else "2" if u <= 2 else "3–5" if u <= 5 else "≥ 6" for u in apart)
    decoder_kind = "rejected drafts left in the cache (fault)" if args.fault else "flashdraft's"
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

"""The training log's held-out τ against what it logged: levers_bench.py's drafters re-scored as training scores
its held-out samples now (each run's seeded held-out pick, its offline feature cache, the serving walk), beside
the last held-out values in the run's metrics.jsonl. Used when the walk's definition changes (issue 31: labels
from the target's argmax instead of the data's tokens) to see what the change does to a logged number.

    .venv/bin/python benchmarks/heldout_walk.py --work /tmp/lev33t --levers demo,labels-target
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from datasets import load_from_disk
from levers_bench import lever_out, score  # benchmarks/levers_bench.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def rescore(work: Path, lever: str) -> dict:
    from flashdraft.config import TrainConfig
    from flashdraft.train.data import run_split
    from flashdraft.train.feature_cache import FeatureCache

    out = lever_out(work, lever)
    cfg = TrainConfig(**yaml.safe_load((work / f"lever-{lever}.yaml").read_text())["train"])
    data = work / "demo" / "dataset"
    _, heldout, _ = run_split(load_from_disk(str(data)), cfg)  # the run's own pick
    cache = FeatureCache(out / "features") if (out / "features").exists() else None
    now = score(out / "drafter", data, cfg.target_dtype, cfg, heldout, cache)
    logged = [json.loads(line)["heldout"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"heldout"' in line][-1]
    return {"work": str(work), "lever": lever, "logged_walk": logged.get("serving_acceptance_length"),
            "walk_now": now["serving_acceptance_length"], "per_anchor_now": now["simulated_acceptance_length"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a levers_bench.py --work directory")
    ap.add_argument("--levers", default="demo")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    for lever in args.levers.split(","):
        print(json.dumps(rescore(args.work, lever)), flush=True)


if __name__ == "__main__":
    main()

"""The training log's held-out walk over samples with and without kin in training (issue 31), on a trained demo
workdir: a held-out sample has kin when another sample's first user turn opens with the same three words
(`flashdraft.records.opening_key`). Scored as training scores its held-out samples (the run's drafter, its
offline feature cache, the serving walk), beside what `flashdraft eval` measured on prompts written apart.

    .venv/bin/python benchmarks/heldout_kin.py --workdir /tmp/demo4    # a demo run with the plain random pick

A dataset made before tokenize wrote `prompt_opening` is keyed from the generate records' messages.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from datasets import load_from_disk
from levers_bench import score  # benchmarks/levers_bench.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def kin_free_by_messages(work: Path, dataset) -> np.ndarray:
    """For a dataset made before tokenize wrote `prompt_opening`: the keys from the generate records' messages."""
    from flashdraft.records import opening_key
    from flashdraft.train.data import kin_free

    messages = {}
    for batch in sorted((work / "generate").glob("batch-*.jsonl")):
        for line in batch.read_text().splitlines():
            record = json.loads(line)
            messages[record["id"]] = record["messages"]
    return kin_free(np.array([opening_key(messages[i]) for i in dataset["id"]]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from flashdraft.artifact.manifest import read_manifest
    from flashdraft.demo import demo_config
    from flashdraft.train.data import run_split
    from flashdraft.train.feature_cache import FeatureCache

    work, cfg = args.workdir, demo_config(args.workdir, full=True).train
    data = work / "dataset"
    dataset = load_from_disk(str(data))
    _, heldout, free = run_split(dataset, cfg)  # the run's own pick
    if free is None:
        free = kin_free_by_messages(work, dataset)
    cache = FeatureCache(work / "train" / "features")
    groups = {"all": heldout, "with kin": [i for i in heldout if not free[i]],
              "without kin": [i for i in heldout if free[i]]}
    eval_tau = read_manifest(work / "eval").stats["acceptance_length"]
    print(f"eval τ {eval_tau:.3f} ({work / 'eval'})")
    for name, ids in groups.items():
        if ids:
            walk = score(work / "train" / "drafter", data, cfg.target_dtype, cfg, ids, cache)
            print(f"{name}: {len(ids)} samples, walk {walk['serving_acceptance_length']:.3f}, "
                  f"gap {walk['serving_acceptance_length'] - eval_tau:+.3f}")


if __name__ == "__main__":
    main()

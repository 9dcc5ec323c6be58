"""A golden loss curve (torchtitan's habit): a tiny deterministic training run whose per-step losses are
committed in tests/assets/golden_loss.json. A change that moves training numbers fails here loudly; an intended
one regenerates the file (FLASHDRAFT_UPDATE_GOLDEN=1) and says so in its commit."""

import json
import os
from pathlib import Path

import pytest
import torch

from flashdraft.artifact.manifest import build_manifest, write_manifest
from flashdraft.config import TrainConfig
from flashdraft.train import run

GOLDEN = Path(__file__).resolve().parent.parent / "assets" / "golden_loss.json"


def golden_dataset(path: Path) -> Path:
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 120, (40 + i,), generator=g).tolist() for i in range(12)]
    rows = {
        "id": [str(i) for i in range(12)],
        "input_ids": sequences,
        "loss_mask": [[0] * 8 + [1] * (len(s) - 8) for s in sequences],
        "num_tokens": [len(s) for s in sequences],
    }
    Dataset.from_dict(rows).save_to_disk(str(path))
    write_manifest(path, build_manifest(path, kind="dataset"))
    return path


def test_training_losses_match_the_golden_curve(tiny_target, tmp_path):
    cfg = TrainConfig(target=tiny_target, num_layers=2, block_size=8, max_anchors=8, batch_size=2, epochs=2, lr=3e-3,
                      checkpoint_every=100, eval_samples=2, mask_token_id=127)
    run(cfg, golden_dataset(tmp_path / "ds"), tmp_path / "out", log=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    if os.environ.get("FLASHDRAFT_UPDATE_GOLDEN"):
        golden = json.loads(GOLDEN.read_text())
        GOLDEN.write_text(json.dumps({**golden, "losses": losses}, indent=1))
    expected = json.loads(GOLDEN.read_text())["losses"]
    assert len(losses) == len(expected) == 10
    # CPU float32: bit-identical on one machine; other CPUs may differ in the last digits (vectorized sums).
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-5)

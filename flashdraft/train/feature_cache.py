"""The offline target-feature cache: the target runs once per sample, training reads features every epoch.

    train.features: offline      # in the pipeline config (or `flashdraft train --features offline`)

For small runs (the CPU demo) the target's forward pass costs as much as the drafter's whole step; caching
its features makes every epoch after the first drafter-only. Size: tokens × n layers × hidden × 2 bytes
(bf16), stated before anything is written (and by `flashdraft estimate`). Large runs keep features online.

Layout: `<train out>/features/` is an artifact (manifest last) holding `features.bin` (bf16 rows, one per
token, samples back to back) and `index.json` (each sample's first row and length). Its lineage is the
dataset, the target and the layers, so a changed input rebuilds it and an unchanged one is reused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import Lineage, check_done, commit_dir, identity, manifest_digest, sha256_json
from flashdraft.config import TrainConfig
from flashdraft.model.target import Target
from flashdraft.progress import progress
from flashdraft.train.distributed import Placement, barrier

DATA, INDEX = "features.bin", "index.json"


class FeatureCache:
    """Read side: each sample's features as a (T × F) float32 tensor, from a memory map."""

    def __init__(self, path: Path) -> None:
        index = json.loads((path / INDEX).read_text())
        self.starts, self.lengths, self.width = index["starts"], index["lengths"], index["width"]
        rows = sum(self.lengths)
        self.data = np.memmap(path / DATA, dtype=np.int16, mode="r", shape=(rows, self.width)) if rows else None

    def __getitem__(self, sample: int) -> torch.Tensor:
        start, length = self.starts[sample], self.lengths[sample]
        raw = torch.from_numpy(np.array(self.data[start : start + length]))
        return raw.view(torch.bfloat16).float()


def feature_bytes(tokens: int, layers: int, hidden: int) -> int:
    """Bytes of cached bf16 features: tokens × layers × hidden × 2 (also what `flashdraft estimate` states)."""
    return tokens * layers * hidden * 2


def build_or_reuse(
    out: Path,
    target,
    dataset,
    max_length: int,
    lineage: Lineage,
    *,
    console=None,
    log: Callable[[str], None] = print,
) -> FeatureCache:
    """The cache at `out` if it verifies with this lineage; else the target runs over every sample once."""
    decision = check_done(out, lineage)
    log(decision.line("features", out))
    if decision.done:
        return FeatureCache(out)
    import pyarrow.compute as pc

    lengths = [min(n, max_length) for n in pc.list_value_length(dataset.data.column("input_ids")).to_pylist()]
    layers, hidden = len(target.layer_ids), target.config.hidden_size
    size = feature_bytes(sum(lengths), layers, hidden)
    log(f"features: caching {sum(lengths):,} tokens × {layers} layers × {hidden} × 2 bytes = {size / 1e6:,.1f} MB")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist() if lengths else []
    stats = {"samples": len(lengths), "tokens": sum(lengths), "width": layers * hidden, "layer_ids": target.layer_ids}
    with commit_dir(out, "features", stats=stats, lineage=lineage) as tmp:
        with open(tmp / DATA, "wb") as f, progress(console, "features", total=len(lengths)) as update:
            for i, length in enumerate(lengths):
                ids = torch.as_tensor(dataset[i]["input_ids"][:length]).long()
                with torch.no_grad():
                    features = target.features(ids[None])[0].to("cpu", torch.bfloat16)
                f.write(features.view(torch.int16).numpy().tobytes())
                update(advance=1)
            f.flush()
            os.fsync(f.fileno())
        atomic_write_text(tmp / INDEX, json.dumps({"starts": starts, "lengths": lengths, "width": layers * hidden}))
    return FeatureCache(out)


def offline_features(cfg: TrainConfig, data: Path, out: Path, target: Target, target_path: str, dataset,
                     place: Placement, console, log) -> FeatureCache:
    """The offline cache under `out/features`: rank 0 builds (or reuses) it, the other ranks then read it."""
    lineage = Lineage(
        inputs=[manifest_digest(data)],
        config=sha256_json({"target": identity(target_path), "layers": target.layer_ids, "max_length": cfg.max_length}),
    )
    if place.rank == 0:
        build_or_reuse(out / "features", target, dataset, cfg.max_length, lineage, console=console, log=log)
    barrier(place.world)
    return FeatureCache(out / "features")

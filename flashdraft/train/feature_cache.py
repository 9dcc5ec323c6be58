"""The offline target-feature cache: the target runs once per sample, training reads features every epoch.

    train.features: offline      # in the pipeline config (or `flashdraft train --features offline`)

For small runs (the CPU demo) the target's forward pass costs as much as the drafter's whole step; caching
its features makes every epoch after the first drafter-only. Size: tokens × n layers × hidden × 2 bytes
(bf16), stated before anything is written (and by `flashdraft estimate`). Large runs keep features online.

Layout: `<train out>/features/` is an artifact (manifest last) holding `features.bin` (bf16 rows, one per
token, samples back to back) and `index.json` (each sample's first row and length). Its lineage is the
dataset, the target and the layers, so a changed input rebuilds it and an unchanged one is reused.

With `train.distill_topk: k` the same target pass also keeps, for every position, the target's k most likely
next tokens and their log-probabilities (`teacher_ids.bin` int32, `teacher_logprobs.bin` float16, T × k): the
soft labels distillation trains on, at 6·k bytes a token — far less than the features themselves. They are
computed only where training reads them (before a supervised token); other rows are zeros.

Samples of similar length share a target pass (right-padded, at most BATCH_TOKENS). On the demo's chat samples
(CPU) that and the top-k only where read give 1.36x the tokens/s of one sample per pass with the top-k at every
position, and without soft labels the cache runs at the bare target's speed (benchmarks/RESULTS.md, "feature
cache").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flashdraft.artifact.atomic import atomic_write_text
from flashdraft.artifact.manifest import Lineage, check_done, identity, sha256_json
from flashdraft.artifact.ownership import commit_dir
from flashdraft.config import TrainConfig
from flashdraft.model.target import Target
from flashdraft.progress import progress
from flashdraft.train.distributed import Placement, barrier
from flashdraft.train.loss import chunk_rows_for

DATA, INDEX = "features.bin", "index.json"
TEACHER_IDS, TEACHER_LOGPROBS = "teacher_ids.bin", "teacher_logprobs.bin"
TEACHER_BYTES = 4 + 2  # per top-k entry: an int32 id and a float16 log-prob


class FeatureCache:
    """Read side: each sample's features as a (T × F) float32 tensor, from a memory map."""

    def __init__(self, path: Path) -> None:
        index = json.loads((path / INDEX).read_text())
        self.starts, self.lengths, self.width = index["starts"], index["lengths"], index["width"]
        rows = sum(self.lengths)
        self.data = np.memmap(path / DATA, dtype=np.int16, mode="r", shape=(rows, self.width)) if rows else None
        self.topk: int = index.get("topk", 0)
        if rows and self.topk:
            shape = (rows, self.topk)
            self.teacher_ids = np.memmap(path / TEACHER_IDS, dtype=np.int32, mode="r", shape=shape)
            self.teacher_logprobs = np.memmap(path / TEACHER_LOGPROBS, dtype=np.float16, mode="r", shape=shape)

    def __getitem__(self, sample: int) -> torch.Tensor:
        start, length = self.starts[sample], self.lengths[sample]
        raw = torch.from_numpy(np.array(self.data[start : start + length]))
        return raw.view(torch.bfloat16).float()

    def teacher(self, sample: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's top-k next tokens after each position of a sample and their log-probabilities (T × k
        each), or None when the cache was built without them."""
        if not self.topk:
            return None
        start, length = self.starts[sample], self.lengths[sample]
        ids = torch.from_numpy(np.array(self.teacher_ids[start : start + length])).long()
        return ids, torch.from_numpy(np.array(self.teacher_logprobs[start : start + length])).float()


def feature_bytes(tokens: int, layers: int, hidden: int, topk: int = 0) -> int:
    """Bytes of the cache (also what `flashdraft estimate` states): bf16 features, tokens × layers × hidden × 2,
    plus the distillation top-k, tokens × k × TEACHER_BYTES."""
    return tokens * (layers * hidden * 2 + topk * TEACHER_BYTES)


def build_or_reuse(
    out: Path,
    target,
    dataset,
    max_length: int,
    lineage: Lineage,
    *,
    topk: int = 0,
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
    size = feature_bytes(sum(lengths), layers, hidden, topk)
    log(f"features: caching {sum(lengths):,} tokens × {layers} layers × {hidden} × 2 bytes"
        + (f" + the target's top {topk} next tokens at each position × {TEACHER_BYTES} bytes" if topk else "")
        + f" = {size / 1e6:,.1f} MB")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist() if lengths else []
    stats = {"samples": len(lengths), "tokens": sum(lengths), "width": layers * hidden, "layer_ids": target.layer_ids,
             "topk": topk}
    with commit_dir(out, "features", stats=stats, lineage=lineage) as tmp:
        columns = {DATA: (np.int16, layers * hidden)}
        if topk:
            columns |= {TEACHER_IDS: (np.int32, topk), TEACHER_LOGPROBS: (np.float16, topk)}
        files = {name: _rows_file(tmp / name, dtype, (sum(lengths), width)) for name, (dtype, width) in columns.items()}
        with progress(console, "features", total=len(lengths), unit="samples") as update:
            for batch in _length_batches(lengths):
                _fill(files, batch, starts, lengths, target, dataset, topk)
                update(advance=len(batch))
        for name, rows in files.items():  # flush the map, then fsync: a crash after the manifest cannot lose rows
            if rows is not None:
                rows.flush()
            with open(tmp / name, "rb+") as handle:
                os.fsync(handle.fileno())
        del files
        atomic_write_text(tmp / INDEX, json.dumps({"starts": starts, "lengths": lengths, "width": layers * hidden,
                                                   "topk": topk}))
    return FeatureCache(out)


BATCH_TOKENS = 1024  # padded tokens per target pass: chat-length samples share one, long ones go alone


def _length_batches(lengths: list[int]) -> list[list[int]]:
    """Sample indices grouped by similar length, each group at most BATCH_TOKENS padded tokens (one sample at
    least): on a CPU a padded batch of long sequences is slower than its sequences apart (see step.plan_batch),
    while short ones gain from sharing a pass."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[i] <= BATCH_TOKENS:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _rows_file(path: Path, dtype, shape: tuple[int, int]):
    """A memory map of the whole file, written sample by sample in any order; None (an empty file) when empty."""
    if shape[0] == 0:
        path.write_bytes(b"")
        return None
    return np.memmap(path, dtype=dtype, mode="w+", shape=shape)


@torch.no_grad()
def _fill(files: dict, batch: list[int], starts: list[int], lengths: list[int], target, dataset, topk: int) -> None:
    """One target pass over a batch of samples (right-padded: the target is causal, so a sample's positions
    never see the padding), each sample's rows written at its place. The top-k is computed only where training
    reads it, before a supervised token; other rows keep zeros (ids 0, log-prob 0), which carry no loss weight."""
    longest = max(lengths[i] for i in batch)
    if longest == 0:
        return
    samples = [dataset[i] for i in batch]  # read once: ids for the pass, loss masks for the top-k
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    for b, i in enumerate(batch):
        ids[b, : lengths[i]] = torch.as_tensor(samples[b]["input_ids"][: lengths[i]])
    output, features = target.forward(ids)
    for b, i in enumerate(batch):
        rows = slice(starts[i], starts[i] + lengths[i])
        files[DATA][rows] = features[b, : lengths[i]].to("cpu", torch.bfloat16).view(torch.int16).numpy()
        if not topk:
            continue
        mask = torch.as_tensor(samples[b]["loss_mask"][: lengths[i]]).bool()
        read = torch.nonzero(mask[1:], as_tuple=True)[0]  # positions p with a supervised token at p + 1
        # a chunk of rows at a time: a whole sample's logits are rows × vocabulary (2K × 248K floats: 2 GB)
        for part in read.split(chunk_rows_for(target.config.vocab_size)):
            logprobs = torch.log_softmax(target.lm_head(output.last_hidden_state[b, part]).float(), dim=-1)
            top = logprobs.topk(topk, dim=-1)
            files[TEACHER_IDS][starts[i] + part.numpy()] = top.indices.to("cpu", torch.int32).numpy()
            files[TEACHER_LOGPROBS][starts[i] + part.numpy()] = top.values.to("cpu", torch.float16).numpy()


def offline_features(cfg: TrainConfig, dataset_digest: str, out: Path, target: Target, target_path: str, dataset,
                     place: Placement, console, log) -> FeatureCache:
    """The offline cache under `out/features`: rank 0 builds (or reuses) it, the other ranks then read it."""
    lineage = Lineage(
        inputs=[dataset_digest],
        config=sha256_json({"target": identity(target_path), "layers": target.layer_ids, "max_length": cfg.max_length,
                            **({"topk": cfg.distill_topk} if cfg.distill_topk else {}),
                            **({"source": "engine"} if cfg.feature_source == "engine" else {}),
                            # features from a bfloat16 target differ: a float32 cache (what every cache before
                            # train.target_dtype was) keeps its lineage, a bfloat16 one gets its own
                            **({"dtype": str(target.model.dtype)} if target.model.dtype != torch.float32 else {})}),
    )
    if place.rank == 0:
        build_or_reuse(out / "features", target, dataset, cfg.max_length, lineage, topk=cfg.distill_topk,
                       console=console, log=log)
    barrier(place.world)
    return FeatureCache(out / "features")

"""The dataset's files: Arrow IPC stream shards named and described as `datasets.save_to_disk` writes them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from flashdraft.artifact.atomic import atomic_open, atomic_write_text
from flashdraft.tokenize.token_counts import TOKEN_COUNTS, TokenCounts


class Row(NamedTuple):
    """One training sample as the shards hold it."""

    id: str
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8


def _value(dtype: str) -> dict[str, str]:
    return {"dtype": dtype, "_type": "Value"}


# The columns as `datasets.Features.to_dict()` describes them. Written out rather than built with `datasets`,
# whose import costs ~0.4 s per run; a test checks this equals what `datasets` itself produces.
FEATURES = {
    "id": _value("string"),
    "input_ids": {"feature": _value("int32"), "_type": "List"},
    "loss_mask": {"feature": _value("uint8"), "_type": "List"},
    "num_tokens": _value("int32"),
}


def arrow_schema():
    import pyarrow as pa

    fields = [("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
              ("num_tokens", pa.int32())]
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})})


class ShardWriter:
    """Arrow IPC stream files named and described as `datasets.save_to_disk` does, each written atomically."""

    def __init__(self, out: Path, rows_per_shard: int) -> None:
        self.out, self.rows_per_shard = out, rows_per_shard
        self.schema = arrow_schema()
        self.pending: list[tuple[str, np.ndarray, np.ndarray]] = []
        self.shard_files: list[str] = []
        self.shard_stats: list[dict[str, Any]] = []
        self.counts = TokenCounts()  # counted here, as the shards are written, so train never scans them

    def add(self, rows: list[Row]) -> None:
        self.pending.extend(rows)
        while len(self.pending) >= self.rows_per_shard:
            self._flush(self.pending[: self.rows_per_shard])
            self.pending = self.pending[self.rows_per_shard :]

    def _flush(self, rows: list[Row]) -> None:
        import pyarrow as pa

        lengths = np.array([len(r.input_ids) for r in rows], dtype=np.int32)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        all_ids = np.concatenate([r.input_ids for r in rows]) if rows else np.zeros(0, np.int32)
        all_mask = np.concatenate([r.loss_mask for r in rows]) if rows else np.zeros(0, np.uint8)
        self.counts.add(all_ids, all_mask)
        table = pa.Table.from_arrays(
            [
                pa.array([r.id for r in rows], pa.string()),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(all_ids, pa.int32())),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(all_mask, pa.uint8())),
                pa.array(lengths, pa.int32()),
            ],
            schema=self.schema,
        )
        name = f"data-{len(self.shard_files):05d}.arrow"  # renamed to -of-N once N is known
        with atomic_open(self.out / name) as f, pa.ipc.new_stream(f, self.schema) as writer:
            writer.write_table(table)
        self.shard_files.append(name)
        self.shard_stats.append(
            {"rows": len(rows), "tokens": int(lengths.sum()), "loss_tokens": int(all_mask.sum(dtype=np.int64))}
        )

    def finish(self, fingerprint: str) -> list[str]:
        if self.pending or not self.shard_files:
            self._flush(self.pending)
            self.pending = []
        n = len(self.shard_files)
        final = [f"data-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
        for old, new in zip(self.shard_files, final, strict=True):
            os.replace(self.out / old, self.out / new)
        info = {"citation": "", "description": "", "features": FEATURES, "homepage": "", "license": ""}
        atomic_write_text(self.out / "dataset_info.json", json.dumps(info, indent=2))
        state = {
            "_data_files": [{"filename": name} for name in final],
            "_fingerprint": fingerprint[:16],
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        atomic_write_text(self.out / "state.json", json.dumps(state, indent=2))
        self.counts.save(self.out / TOKEN_COUNTS)
        return final

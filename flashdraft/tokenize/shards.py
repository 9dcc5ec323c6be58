"""The dataset's files: Arrow IPC stream shards named and described as `datasets.save_to_disk` writes them."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
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
    prompt_opening: int  # flashdraft.records.opening_key of its conversation: which samples are kin


def _value(dtype: str) -> dict[str, str]:
    return {"dtype": dtype, "_type": "Value"}


# The columns as `datasets.Features.to_dict()` describes them. Written out rather than built with `datasets`,
# whose import costs ~0.4 s per run; a test checks this equals what `datasets` itself produces.
FEATURES = {
    "id": _value("string"),
    "input_ids": {"feature": _value("int32"), "_type": "List"},
    "loss_mask": {"feature": _value("uint8"), "_type": "List"},
    "num_tokens": _value("int32"),
    "prompt_opening": _value("int64"),
}


def arrow_schema():
    import pyarrow as pa

    fields = [("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
              ("num_tokens", pa.int32()), ("prompt_opening", pa.int64())]
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})})


BATCH_ROWS = 1000  # rows per Arrow record batch: all the writer holds (~10 MB at 2K tokens a row)


class ShardWriter:
    """Arrow IPC stream files named and described as `datasets.save_to_disk` does, each written atomically.

    A shard is written a record batch at a time as rows arrive, so memory stays at one batch however many rows
    a shard holds (20,000 rows of 2K tokens would be ~200 MB held, and twice that while concatenated)."""

    def __init__(self, out: Path, rows_per_shard: int) -> None:
        self.out, self.rows_per_shard = out, rows_per_shard
        self.schema = arrow_schema()
        self.pending: list[Row] = []
        self.shard_files: list[str] = []
        self.shard_stats: list[dict[str, Any]] = []
        self.counts = TokenCounts()  # counted here, as the shards are written, so train never scans them
        self.current: tuple[ExitStack, Any] | None = None  # the open shard: its temp file's scope, its writer

    def add(self, rows: list[Row]) -> None:
        self.pending.extend(rows)
        while len(self.pending) >= (room := self._room()):
            self._write(self.pending[:room])
            self.pending = self.pending[room:]

    def _room(self) -> int:
        """Rows the next batch may take: a batch never straddles two shards."""
        return min(BATCH_ROWS, self.rows_per_shard - (self.shard_stats[-1]["rows"] if self.current else 0))

    def _write(self, rows: list[Row]) -> None:
        import pyarrow as pa

        if self.current is None:
            name = f"data-{len(self.shard_files):05d}.arrow"  # renamed to -of-N once N is known
            scope = ExitStack()
            f = scope.enter_context(atomic_open(self.out / name))
            self.current = (scope, scope.enter_context(pa.ipc.new_stream(f, self.schema)))
            self.shard_files.append(name)
            self.shard_stats.append({"rows": 0, "tokens": 0, "loss_tokens": 0})
        lengths = np.array([len(r.input_ids) for r in rows], dtype=np.int32)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        all_ids = np.concatenate([r.input_ids for r in rows]) if rows else np.zeros(0, np.int32)
        all_mask = np.concatenate([r.loss_mask for r in rows]) if rows else np.zeros(0, np.uint8)
        self.counts.add(all_ids, all_mask)
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array([r.id for r in rows], pa.string()),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(all_ids, pa.int32())),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(all_mask, pa.uint8())),
                pa.array(lengths, pa.int32()),
                pa.array([r.prompt_opening for r in rows], pa.int64()),
            ],
            schema=self.schema,
        )
        self.current[1].write_batch(batch)
        stats = self.shard_stats[-1]
        stats["rows"] += len(rows)
        stats["tokens"] += int(lengths.sum())
        stats["loss_tokens"] += int(all_mask.sum(dtype=np.int64))
        if stats["rows"] >= self.rows_per_shard:
            self._close()

    def _close(self) -> None:
        scope, _ = self.current
        self.current = None
        scope.close()  # ends the stream, then fsyncs the temp file and renames it into place

    def abort(self) -> None:
        """A failed run: the open shard's temp file is removed, not committed."""
        if self.current is not None:
            scope, _ = self.current
            self.current = None
            scope.__exit__(RuntimeError, RuntimeError("tokenize failed"), None)

    def finish(self, fingerprint: str) -> list[str]:
        if self.pending or not self.shard_files:
            self._write(self.pending)
            self.pending = []
        if self.current is not None:
            self._close()
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

"""How often each token id occurs in a dataset, in all and where supervised: what train needs to know about
the data (the largest id, the ids never used for a mask token, the most supervised ids for a draft vocabulary).

Tokenize counts them in the pass that writes the shards and ships them in the dataset as
`token_counts.safetensors` (two int64 vectors, a few MB however large the dataset), so a training start-up —
on every rank, every resume — reads them instead of scanning 2 B tokens. A dataset made before this file
existed (or by another tool) is counted once by `count_dataset`: one vectorised pass over Arrow record
batches, never a Python loop over rows and never one array of every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashdraft.artifact.atomic import write_safetensors
from flashdraft.errors import BadInput

TOKEN_COUNTS = "token_counts.safetensors"
BATCH_ROWS = 2048  # record batches of the fallback pass: ~4M tokens (~20 MB of ids and masks) at a time


@dataclass
class TokenCounts:
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # occurrences of each id
    supervised: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # ... where loss_mask is 1

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """Count one batch of rows: their token ids concatenated, and the loss mask beside them."""
        if len(ids) == 0:
            return
        self.tokens = _plus(self.tokens, np.bincount(ids))
        self.supervised = _plus(self.supervised, np.bincount(ids[mask.astype(bool)]))

    def minus(self, other: TokenCounts) -> TokenCounts:
        """These counts without `other`'s (the held-out rows taken out of the whole dataset's)."""
        n = max(len(self.tokens), len(other.tokens))
        return TokenCounts(_pad(self.tokens, n) - _pad(other.tokens, n), _pad(self.supervised, n)
                           - _pad(other.supervised, n))

    @property
    def largest_id(self) -> int:
        """The largest id that occurs (−1 for no tokens at all)."""
        used = np.flatnonzero(self.tokens)
        return int(used[-1]) if len(used) else -1

    def unused_ids(self, vocab_size: int) -> np.ndarray:
        """The ids below `vocab_size` that never occur, ascending."""
        return np.flatnonzero(_pad(self.tokens, vocab_size)[:vocab_size] == 0)

    def most_supervised(self, size: int, vocab_size: int) -> np.ndarray:
        """The `size` ids most often supervised (ties: lower id first), sorted by id."""
        counts = _pad(self.supervised, vocab_size)[:vocab_size]
        order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
        return np.sort(order[:size])

    def save(self, path: Path) -> None:
        import torch

        write_safetensors({"tokens": torch.from_numpy(self.tokens), "supervised": torch.from_numpy(self.supervised)},
                          path)

    @classmethod
    def load(cls, path: Path) -> TokenCounts:
        from safetensors.numpy import load_file

        loaded = load_file(str(path))
        return cls(loaded["tokens"], loaded["supervised"])


def _pad(counts: np.ndarray, n: int) -> np.ndarray:
    return counts if len(counts) >= n else np.concatenate((counts, np.zeros(n - len(counts), np.int64)))


def _plus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = max(len(a), len(b))
    return _pad(a, n) + _pad(b.astype(np.int64), n)


def count_rows(dataset, rows: list[int]) -> TokenCounts:
    """Counts over a few rows (the held-out pick): small, read row by row."""
    counts = TokenCounts()
    for i in rows:
        row = dataset[i]
        counts.add(np.asarray(row["input_ids"]), np.asarray(row["loss_mask"]))
    return counts


def count_dataset(dataset) -> TokenCounts:
    """Counts over a whole `datasets` dataset (one without a counts file), a record batch at a time."""
    counts = TokenCounts()
    for batch in dataset.data.table.to_batches(max_chunksize=BATCH_ROWS):
        ids = batch.column("input_ids").flatten().to_numpy(zero_copy_only=False)
        mask = batch.column("loss_mask").flatten().to_numpy(zero_copy_only=False)
        if len(ids) and ids.min() < 0:
            raise BadInput(f"the dataset holds a negative token id ({ids.min()}): it was not written by a tokenizer")
        counts.add(ids, mask)
    return counts

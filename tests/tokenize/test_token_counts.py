"""The token counts tokenize ships beside the shards, and what train derives from them instead of scanning every
token: the largest id, the mask token, the draft vocabulary (over the training rows only)."""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import torch
from datasets import load_from_disk

from flashdraft.artifact.manifest import read_manifest, verify_dir
from flashdraft.config import TokenizeConfig, TrainConfig
from flashdraft.tokenize import run
from flashdraft.tokenize.token_counts import TOKEN_COUNTS, TokenCounts, count_dataset, count_rows
from flashdraft.train.data import choose_draft_vocab, pick_mask_token, split_heldout, token_counts
from tests.tokenize.test_tokenize import conv, write_jsonl


def naive_counts(rows, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row, one token at a time: what the counts must equal."""
    tokens, supervised = np.zeros(vocab_size, np.int64), np.zeros(vocab_size, np.int64)
    for row in rows:
        for token, m in zip(row["input_ids"], row["loss_mask"], strict=True):
            tokens[token] += 1
            supervised[token] += int(m)
    return tokens, supervised


def tokenized(tmp_path, smollm2_dir, n: int = 60):
    from transformers import AutoTokenizer

    # each answer has a word of its own (so a held-out row's words are not all in the training rows)
    words = [AutoTokenizer.from_pretrained(smollm2_dir).decode([5000 + 7 * i]) for i in range(n)]
    records = [conv(f"Question {i}? " * (i % 7 + 1), f"Answer {words[i]}, part {i % 3}. " * (i % 5 + 2))
               for i in range(n)]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    cfg = TokenizeConfig(tokenizer=smollm2_dir, workers=1, rows_per_shard=16, min_loss_fraction=0.0)
    stats = run(cfg, src, tmp_path / "ds", log=lambda s: None)
    return tmp_path / "ds", stats


def test_tokenize_counts_every_token_in_the_pass_that_writes_the_shards(tmp_path, smollm2_dir):
    data, stats = tokenized(tmp_path, smollm2_dir)
    dataset = load_from_disk(str(data))
    rows = list(dataset)
    tokens, supervised = naive_counts(rows, 49152)
    counts = TokenCounts.load(data / TOKEN_COUNTS)
    assert np.array_equal(np.pad(counts.tokens, (0, 49152 - len(counts.tokens))), tokens)
    assert np.array_equal(np.pad(counts.supervised, (0, 49152 - len(counts.supervised))), supervised)
    assert stats["largest_token_id"] == max(max(r["input_ids"]) for r in rows) == counts.largest_id
    assert stats["longest"] == max(len(r["input_ids"]) for r in rows)
    assert stats["token_counts"] == TOKEN_COUNTS and len(stats["shards"]) == 4  # counted across shards
    assert TOKEN_COUNTS in {f.path for f in read_manifest(data).files} and verify_dir(data) == []
    # A dataset without the file (an older one, another tool's) is counted by the vectorised pass: the same.
    again = count_dataset(dataset)
    assert np.array_equal(again.tokens, counts.tokens) and np.array_equal(again.supervised, counts.supervised)


def test_mask_token_and_draft_vocab_from_counts_equal_a_scan_of_the_training_rows(tmp_path, smollm2_dir,
                                                                                 tiny_model_dir):
    from transformers import AutoConfig

    data, _ = tokenized(tmp_path, smollm2_dir)
    dataset = load_from_disk(str(data)).with_format("numpy", columns=["input_ids", "loss_mask"])
    counts = token_counts(data, dataset, world=1)
    train_ids, heldout_ids = split_heldout(len(dataset), eval_samples=6, seed=0)
    assert heldout_ids  # the held-out rows are taken out of the draft vocabulary's counts
    tokens, _ = naive_counts(list(dataset), 49152)
    _, train_supervised = naive_counts([dataset[i] for i in train_ids], 49152)

    size = int((counts.supervised > 0).sum())  # every id supervised anywhere: held-out-only ones must drop out
    vocab = choose_draft_vocab(counts.minus(count_rows(dataset, heldout_ids)), size, 49152)
    order = np.lexsort((np.arange(49152), -train_supervised))
    assert torch.equal(vocab, torch.from_numpy(np.sort(order[:size])))
    with_heldout = choose_draft_vocab(counts, size, 49152)
    assert not torch.equal(vocab, with_heldout)  # the subtraction matters on this data: the test can fail

    # No tokenizer beside the weights and no padded row: the highest id the data never holds.
    target_config = AutoConfig.from_pretrained(tiny_model_dir)
    target_config.vocab_size = 49152
    mask = pick_mask_token(TrainConfig(target=tiny_model_dir), target_config, str(tmp_path / "no-tokenizer"), counts)
    assert mask == int(np.flatnonzero(tokens == 0)[-1])


def test_rank_zero_counts_and_the_other_rank_receives(tmp_path):
    """Under torchrun only rank 0 runs the count; rank 1's would fail if it ran."""
    script = tmp_path / "share.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        from flashdraft.train.distributed import from_rank_zero, setup_distributed
        rank, world = setup_distributed()
        def compute():
            if rank != 0:
                raise SystemExit("rank 1 computed")
            return [torch.arange(7), torch.tensor([3, 1, 4], dtype=torch.int64)]
        got = from_rank_zero(world, compute, 2)
        open(sys.argv[1] + f".{rank}", "w").write(repr([v.tolist() for v in got]))
        torch.distributed.barrier()  # as a run goes on to train: no rank leaves while another still reads
        torch.distributed.destroy_process_group()
    """))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           port, str(script), str(tmp_path / "got")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = repr([list(range(7)), [3, 1, 4]])
    assert (tmp_path / "got.0").read_text() == expected == (tmp_path / "got.1").read_text()


def test_shards_are_written_a_record_batch_at_a_time(tmp_path, smollm2_dir, monkeypatch):
    """The writer holds one batch of rows, not a shard's worth: shards are streams of batches that never
    straddle two shards, and they read back as the rows in order."""
    import pyarrow as pa

    import flashdraft.tokenize.shards as shards

    monkeypatch.setattr(shards, "BATCH_ROWS", 10)
    records = [conv(f"Question {i}?", f"Answer {i}.") for i in range(60)]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    cfg = TokenizeConfig(tokenizer=smollm2_dir, workers=1, rows_per_shard=25, min_loss_fraction=0.0)
    stats = run(cfg, src, tmp_path / "ds", log=lambda s: None)
    files = [s["file"] for s in stats["shards"]]
    batches = []
    for name in files:
        with pa.ipc.open_stream(pa.memory_map(str(tmp_path / "ds" / name))) as reader:
            batches.append([b.num_rows for b in reader])
    assert batches == [[10, 10, 5], [10, 10, 5], [10]]
    assert [s["rows"] for s in stats["shards"]] == [25, 25, 10]
    monkeypatch.setattr(shards, "BATCH_ROWS", 1000)  # one shard, one batch: the same rows in the same order
    whole = TokenizeConfig(tokenizer=smollm2_dir, workers=1, min_loss_fraction=0.0)
    run(whole, src, tmp_path / "one", log=lambda s: None)
    assert list(load_from_disk(str(tmp_path / "ds"))) == list(load_from_disk(str(tmp_path / "one")))

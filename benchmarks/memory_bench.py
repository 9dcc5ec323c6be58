"""memory benchmark: peak tensor memory of the drafter's loss and training step, by scored rows and vocabulary.

    .venv/bin/python benchmarks/memory_bench.py [--vocab 248320] [--length 2048] [--no-record]

Two tables, measured on a CPU with `memory_counter.MemoryCounter` (what a GPU's `max_memory_allocated` counts):
- the loss alone (forward and backward over S scored rows of a V-token LM head): the dense computation (the S × V
  logits at once, as the loss was computed before train/loss.py) beside flashdraft's, a chunk of rows at a time;
- one training step of a random target with Qwen3.6's vocabulary (248,320 tokens, untied head) and a tiny body,
  samples of `--length` tokens, the target's labels, micro_batch 4, block 16, at 512 and 2,048 scored rows a
  micro-batch; then the held-out serving walk over one sample and the offline cache with the top 16, each on its own.
The figures are what the code added at its peak over the weights. Results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
from memory_counter import MemoryCounter  # beside this script
from record import record  # benchmarks/record.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def loss_peak(rows: int, vocab: int, dense: bool, hidden: int = 64) -> int:
    from flashdraft.train.loss import head_terms

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g, requires_grad=True)
    head = torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    with MemoryCounter() as counter:
        if dense:
            ce = torch.nn.functional.cross_entropy((x @ head.T).float(), labels, reduction="none")
        else:
            ce = head_terms(x, head, labels_S=labels).ce
        ce.sum().backward()
    return counter.peak_bytes


def qwen36_vocab_target(path: Path, vocab: int) -> str:
    """A random Qwen3 body of 4 layers, hidden 64, with Qwen3.6's vocabulary and an untied head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


def samples(vocab: int, length: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.long)
        mask[length // 4 :] = 1  # the prompt unsupervised, the answer supervised
        rows.append((ids, mask))
    return rows


def step_peaks(target_dir: str, vocab: int, length: int) -> dict[str, int]:
    """Peak of one step at 512 and at 2,048 scored rows a micro-batch; of the held-out walk over one sample; of
    building the offline cache with the top 16 over four samples."""
    import datasets

    from flashdraft.artifact.manifest import Lineage
    from flashdraft.config import TrainConfig
    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.target import Target
    from flashdraft.train.feature_cache import build_or_reuse
    from flashdraft.train.heldout import serving_walk
    from flashdraft.train.step import batch_step

    target = Target(target_dir, "cpu", lambda s: None)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=1, block_size=16, mask_token_id=0))
    target.watch(drafter.target_layer_ids)
    rows = samples(vocab, length, 4)
    peaks = {}
    for scored in (512, 2048):
        cfg = TrainConfig(target=target_dir, block_size=16, max_anchors=scored // (4 * 16), micro_batch=4,
                          batch_size=4, labels="target", max_length=length)
        generators = [torch.Generator().manual_seed(i) for i in range(4)]
        with MemoryCounter() as counter:
            results = batch_step(drafter, target, rows, cfg, generators, "cpu")
            sum(r["weighted_ce"] for r in results if r).backward()
        peaks[f"step, {scored:,} scored rows"] = counter.peak_bytes
        drafter.zero_grad(set_to_none=True)
        del results
    with MemoryCounter() as counter:
        serving_walk(drafter, target, rows[0][0], rows[0][1], cfg, "cpu")
    peaks["held-out serving walk, one sample"] = counter.peak_bytes
    with tempfile.TemporaryDirectory() as work:
        dataset = datasets.Dataset.from_dict({"input_ids": [r[0].tolist() for r in rows],
                                              "loss_mask": [r[1].tolist() for r in rows]})
        with MemoryCounter() as counter:
            build_or_reuse(Path(work) / "features", target, dataset, length,
                           Lineage(inputs=[], config="memory-bench"), topk=16, log=lambda s: None)
        peaks["offline cache, top 16"] = counter.peak_bytes
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    gb = 1e9
    lines = ["| scored rows | vocabulary | dense loss peak | flashdraft's loss peak |", "| ---: | ---: | ---: | ---: |"]
    for vocab in (49_152, args.vocab):
        for rows in (512, 2048):
            dense, chunked = loss_peak(rows, vocab, True), loss_peak(rows, vocab, False)
            lines.append(f"| {rows:,} | {vocab:,} | {dense / gb:.2f} GB | {chunked / gb:.2f} GB |")
    with tempfile.TemporaryDirectory() as work:
        peaks = step_peaks(qwen36_vocab_target(Path(work) / "target", args.vocab), args.vocab, args.length)
    lines += ["", f"| one training step's part (vocabulary {args.vocab:,}, {args.length:,}-token samples, "
              "micro_batch 4, block 16, labels: target) | peak over the weights |", "| --- | ---: |"]
    lines += [f"| {name} | {peak / gb:.2f} GB |" for name, peak in peaks.items()]
    small, large = peaks["step, 512 scored rows"], peaks["step, 2,048 scored rows"]
    per_row = (large - small) / 1536 / (4 * args.vocab)
    lines.append(f"\ngrowth per added scored row: {per_row:.3f} float32 vocabulary rows")
    header = [f"## Memory: the loss a chunk of rows at a time ({datetime.now(UTC).date().isoformat()}, "
              "`benchmarks/memory_bench.py`, CPU, float32, peak tensor memory counted by benchmarks/memory_counter.py)",
              ""]
    record(header + lines, keep=not args.no_record)


if __name__ == "__main__":
    main()

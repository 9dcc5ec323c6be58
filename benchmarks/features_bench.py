"""Offline feature cache: flashdraft's build vs the target's bare forward (the bound) vs one sample per pass.

    .venv/bin/flashdraft run examples/demo.yaml --until tokenize      # the demo's dataset, if not there yet
    .venv/bin/python benchmarks/features_bench.py [--data flashdraft-work/dataset] [--samples 256]

On the first `--samples` samples of a tokenized dataset (the demo's: chat prompts with answers, ~105 tokens)
and the embedded SmolLM2 target (float32, CPU), in tokens/s:
  (a) the bound: the target's decoder alone over the same samples, in the same length batches, no hooks, no
      LM head, nothing written — what any cache of these features has to compute;
  (b) `build_or_reuse` as `flashdraft train --features offline` runs it, with the demo's top-16 soft labels
      (distill_topk 16) and without;
  (c) the way flashdraft built it before (and the simplest peer script): one sample per target pass, the
      top-k over the full vocabulary at every position;
  (d) with --engine: `build_or_reuse` with the features from vLLM's CPU build (`train.feature_source: engine`,
      started once before the rounds, as train starts it once a run; scripts/engines.sh installs it).
Each runs `--rounds` times, interleaved; the fastest counts. Results are appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

from record import record  # benchmarks/record.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "flashdraft-work" / "dataset")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--engine", action="store_true", help="also (d): the features from vLLM")
    args = ap.parse_args()
    if not (args.data / "manifest.json").is_file():
        sys.exit(f"{args.data}: no tokenized dataset; run `flashdraft run examples/demo.yaml --until tokenize`")

    import torch
    from datasets import load_from_disk

    from flashdraft.artifact.manifest import Lineage
    from flashdraft.demo import DEMO_SETTINGS
    from flashdraft.model.resolve import resolve_model
    from flashdraft.model.target import Target
    from flashdraft.train.feature_cache import _length_batches, build_or_reuse

    torch.set_grad_enabled(False)
    dataset = load_from_disk(str(args.data)).with_format("numpy", columns=["input_ids", "loss_mask"])
    dataset = dataset.select(range(min(args.samples, len(dataset))))
    lengths = [len(row["input_ids"]) for row in dataset]
    tokens = sum(lengths)
    target = Target(resolve_model("embedded", log=lambda s: None), "cpu", lambda s: None)
    layers = DEMO_SETTINGS["train.target_layer_ids"]
    topk = DEMO_SETTINGS["train.distill_topk"]

    def bound() -> None:
        target.watch([])
        for batch in _length_batches(lengths):
            ids = torch.zeros(len(batch), max(lengths[i] for i in batch), dtype=torch.long)
            for b, i in enumerate(batch):
                ids[b, : lengths[i]] = torch.as_tensor(dataset[i]["input_ids"])
            target.decoder(input_ids=ids)

    def flashdraft(k: int):
        def build() -> None:
            target.watch(layers)
            out = Path(tempfile.mkdtemp()) / "features"
            build_or_reuse(out, target, dataset, 512, Lineage(inputs=[], config=str(k)), topk=k, log=lambda s: None)
            shutil.rmtree(out.parent)
        return build

    def one_by_one() -> None:
        target.watch(layers)
        for i in range(len(dataset)):
            output, features = target.forward(torch.as_tensor(dataset[i]["input_ids"]).long()[None])
            features[0].to(torch.bfloat16)
            logprobs = torch.log_softmax(target.lm_head(output.last_hidden_state[0]).float(), dim=-1)
            logprobs.topk(topk, dim=-1)

    running = ExitStack()
    engine = None
    if args.engine:
        from flashdraft.config import TrainConfig
        from flashdraft.train.engine_features import engine_features

        target.watch(layers)  # the engine gives these and the last layer (model/target.py source_layers)
        engine = running.enter_context(engine_features(
            TrainConfig(feature_source="engine", max_length=512), target.path, target.source_layers(),
            target.config.hidden_size, [],
            Path(tempfile.mkdtemp()) / "engine-vllm.log", print))

    def from_engine() -> None:
        target.use(engine)
        try:
            flashdraft(0)()
        finally:
            target.use(None)

    methods = {
        "(a) bound: the target's decoder alone, length batches": bound,
        f"(b) flashdraft build_or_reuse, top-{topk} soft labels (the demo's)": flashdraft(topk),
        "(b) flashdraft build_or_reuse, features only": flashdraft(0),
        f"(c) one sample per pass, top-{topk} at every position (flashdraft before)": one_by_one,
        **({"(d) flashdraft build_or_reuse, features only, from vLLM 0.32 (CPU build, float32)": from_engine}
           if engine is not None else {}),
    }
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(args.rounds):
        for name, method in methods.items():
            started = time.perf_counter()
            method()
            best[name] = min(best[name], time.perf_counter() - started)
            print(f"{name}: {tokens / best[name]:,.0f} tok/s", flush=True)

    running.close()
    bound_rate = tokens / best[next(iter(methods))]
    lines = [
        f"### feature cache — {datetime.now(UTC):%Y-%m-%d} — SmolLM2-135M float32, CPU, {torch.get_num_threads()} "
        f"threads, {len(dataset)} demo samples ({tokens:,} tokens), layers {layers}",
        "",
        f"Command: `.venv/bin/python benchmarks/features_bench.py --data {args.data} --samples {args.samples} "
        f"--rounds {args.rounds}{' --engine' if args.engine else ''}` (fastest of the rounds)",
        "",
        "| method | tokens/s | vs the bound | vs one sample per pass |",
        "| --- | --- | --- | --- |",
    ]
    before = tokens / best[f"(c) one sample per pass, top-{topk} at every position (flashdraft before)"]
    for name, seconds in best.items():
        rate = tokens / seconds
        lines.append(f"| {name} | {rate:,.0f} | {rate / bound_rate:.2f} | {rate / before:.2f} |")
    record(lines, keep=not args.no_record)


if __name__ == "__main__":
    main()

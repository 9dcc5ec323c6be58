"""Reference text as more training data, with the target's soft labels only: issue 20's data lever that needs no
generation.

    .venv/bin/python benchmarks/levers_bench.py --work /tmp/levers --levers distill-1.0  # demo data, held-out answers
    .venv/bin/python benchmarks/reference_text_bench.py --work /tmp/levers [--steps 2600]

Generating answers is what makes a distinct training prompt cost (~0.1 s each in the demo); the feature cache
reads any text at ~3x the speed. With distillation weight 1 the drafter learns only the target's own next-token
distributions (top-16 from the cache), so the text need not be the target's: here it is Python's own reference
documentation, which every Python install carries (the language reference topics in `pydoc_data` and the
standard library's docstrings of over 300 characters), cut at paragraph ends into ~350–600-character chunks, each an
assistant turn after "Explain: <its first line>". They join the demo's generated answers (rewritten as
conversations: `flashdraft tokenize` takes one kind of input per dataset), a drafter with the demo's train
settings and distillation weight 1 trains on both, and is scored on the held-out answers the way levers_bench
scores a lever; compare with levers_bench's `distill-1.0` (the same, on the demo's answers alone).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import sys
import warnings
from pathlib import Path

import yaml
from levers_bench import ROOT, flashdraft, heldout_dataset, score  # beside this script

SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtledemo"}  # side effects or a display


def reference_texts() -> list[str]:
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    warnings.simplefilter("ignore")
    for name in sorted(sys.stdlib_module_names - SKIPPED_MODULES):
        if name.startswith("_"):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # platform-specific or optional modules
            continue
        for obj in [module, *(getattr(module, attr, None) for attr in dir(module) if not attr.startswith("_"))]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 300 and getattr(obj, "__module__", name) in (name, None):
                texts.append(doc)
    return texts


def conversations(texts: list[str], min_chars: int = 350, max_chars: int = 600) -> list[dict]:
    """Paragraphs gathered into chunks of at least `min_chars` (cut at `max_chars`), duplicates dropped."""
    rows, seen = [], set()
    for text in texts:
        chunk = ""
        for paragraph in (p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()):
            chunk = f"{chunk}\n\n{paragraph}" if chunk else paragraph
            if len(chunk) > min_chars:
                key = hashlib.sha1(chunk.encode()).hexdigest()[:16]
                if key not in seen:
                    seen.add(key)
                    rows.append({"id": f"ref-{key}", "messages": [
                        {"role": "user", "content": "Explain: " + chunk.split("\n")[0][:120]},
                        {"role": "assistant", "content": chunk[:max_chars]}]})
                chunk = ""
    return rows


def generated_as_conversations(generated: Path) -> list[dict]:
    rows = []
    for batch in sorted(generated.glob("batch-*.jsonl")):
        for line in batch.read_text().splitlines():
            r = json.loads(line)
            rows.append({"id": r["id"], "messages": [*r["messages"], {"role": "assistant", "content": r["content"]}]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/levers"), help="levers_bench's work directory")
    ap.add_argument("--steps", type=int, default=2600, help="optimizer steps of the drafter")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    base = yaml.safe_load((args.work / "demo.yaml").read_text())  # levers_bench wrote it: the demo's settings
    out = args.work / "reference-text"
    out.mkdir(parents=True, exist_ok=True)
    reference = conversations(reference_texts())
    demo = generated_as_conversations(Path(base["workdir"]) / "generate")
    for name, rows in (("reference.jsonl", reference), ("demo.jsonl", demo)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    flashdraft("tokenize", "--input", str(out / "demo.jsonl"), "--input", str(out / "reference.jsonl"),
               "--out", str(out / "dataset"), "--max-length", str(base["tokenize"]["max_length"]),
               "--block-size", str(base["tokenize"]["block_size"]))
    config = out / f"train-{args.steps}.yaml"
    config.write_text(yaml.safe_dump({**base, "train": {**base["train"], "max_steps": args.steps,
                                                        "distill_weight": 1.0}}))
    trained = out / f"train-{args.steps}"
    flashdraft("train", "--config", str(config), "--data", str(out / "dataset"), "--out", str(trained))
    row = {"reference_chunks": len(reference), "demo_samples": len(demo), "steps": args.steps,
           **score(trained / "drafter", heldout_dataset(args.work))}
    print(json.dumps(row))


if __name__ == "__main__":
    main()

"""One harness for every lever: what a setting or a data recipe buys in τ, measured side by side.

    .venv/bin/python benchmarks/levers.py --levers demo,no-distill,muon            # the quick demo's base
    .venv/bin/python benchmarks/levers.py --base full --levers demo,steps-x2 --work /tmp/levers-full
    .venv/bin/python benchmarks/levers.py --levers demo,lr-1e-3 --set train.max_steps=50   # any base setting

A lever (benchmarks/levers.yaml) is a named set of config overrides on top of the demo's settings, plus, where
it needs one, a data recipe (generate / tokenize overrides). Each distinct recipe's data is built once under
--work by the real stages: `flashdraft generate` once for each distinct generate recipe (levers that differ only in
how they tokenize, as block-8 does, share the target's answers: generation is most of the data's time), then
`flashdraft tokenize` of those answers; every lever then trains its own drafter with the real `flashdraft train`
from that data with the same seeds, and is scored two ways:
- `flashdraft eval` on the base's held-out prompts (builtin:chat-heldout: hand-written, no training prompt shares
  a template with them): τ by decoding, lossless checked;
- the training log's walk: the last held-out record in the run's metrics.jsonl (the serving walk over held-out
  samples, what the log predicts eval will measure).
Beside them, the training loop's time from the drafter's manifest. The table is printed and appended to
benchmarks/RESULTS.md (not with --no-record). Runs are reused when their artifact verifies (rerun = no-op).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import yaml
from record import record  # benchmarks/record.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "flashdraft"]
LEVERS = Path(__file__).resolve().parent / "levers.yaml"


def flashdraft(*args: str) -> None:
    proc = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"flashdraft {' '.join(args[:1])} failed:\n{proc.stderr[-2000:]}")


def dotted(settings: dict, section: str, changes: dict | None) -> None:
    """Apply a lever's overrides to a flat `section.key` dict; a null removes the key (flashdraft's default)."""
    for key, value in (changes or {}).items():
        if value is None:
            settings.pop(f"{section}.{key}", None)
        else:
            settings[f"{section}.{key}"] = value


def lever_settings(base: dict, lever: dict) -> dict:
    settings = dict(base)
    for section in ("generate", "tokenize"):
        dotted(settings, section, (lever.get("data") or {}).get(section))
    for section in ("train", "eval"):
        dotted(settings, section, lever.get(section))
    if "steps_factor" in lever:
        settings["train.max_steps"] = int(settings["train.max_steps"] * lever["steps_factor"])
    return settings


def as_config(settings: dict, workdir: Path) -> dict:
    from flashdraft.config import load_config

    return load_config(None, {"workdir": str(workdir), **settings}).model_dump(mode="json", exclude_unset=True)


def data_key(settings: dict, sections: tuple[str, ...] = ("generate", "tokenize")) -> str:
    """Levers whose settings of these sections agree share their output: one dataset (generate and tokenize), one
    generation (generate alone)."""
    recipe = {k: v for k, v in sorted(settings.items()) if k.split(".")[0] in sections}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def walk(out: Path) -> float | None:
    """The serving walk of the last held-out record in a run's metrics.jsonl."""
    held = [json.loads(line)["heldout"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "heldout" in line]
    return held[-1].get("serving_acceptance_length") if held else None


def run_lever(name: str, lever: dict, base: dict, work: Path) -> dict:
    from flashdraft.artifact.manifest import read_manifest

    settings = lever_settings(base, lever)
    data_dir = work / f"data-{data_key(settings)}"  # its dataset/ lives under it
    answers = work / f"generate-{data_key(settings, ('generate',))}"  # shared by every tokenize recipe
    config = work / f"lever-{name}.yaml"
    config.write_text(yaml.safe_dump(as_config(settings, data_dir)))
    flashdraft("generate", "--config", str(config), "--out", str(answers))  # a done one says so in seconds
    flashdraft("tokenize", "--config", str(config), "--input", str(answers), "--out", str(data_dir / "dataset"))
    out = work / f"lever-{name}"
    flashdraft("train", "--config", str(config), "--data", str(data_dir / "dataset"), "--out", str(out))
    flashdraft("eval", "--config", str(config), "--drafter", str(out / "drafter"), "--out", str(work / f"eval-{name}"))
    stats = read_manifest(work / f"eval-{name}").stats
    return {"lever": name, "what": lever["what"], "train_s": read_manifest(out / "drafter").stats["seconds"],
            "tau": stats["acceptance_length"], "lossless": stats["lossless"], "walk": walk(out),
            "data": data_dir.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levers", default="demo,no-distill", help="names from benchmarks/levers.yaml, comma-separated")
    ap.add_argument("--base", choices=["quick", "full"], default="quick", help="the quick demo's settings or the full")
    ap.add_argument("--work", type=Path, default=Path("/tmp/levers"))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="change the base for every lever (YAML values), e.g. train.max_steps=50")
    ap.add_argument("--no-record", action="store_true", help="print the table only")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON object")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from flashdraft.demo import DEMO_SETTINGS, QUICK_SETTINGS, for_this_cpu

    known = yaml.safe_load(LEVERS.read_text())
    names = args.levers.split(",")
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown lever(s) {', '.join(unknown)}: benchmarks/levers.yaml has {', '.join(known)}")
    # the demo's settings as the demo runs them on this CPU (float32 where bfloat16 would be emulated: demo.py)
    base = {**for_this_cpu(QUICK_SETTINGS if args.base == "quick" else DEMO_SETTINGS),
            **{key: yaml.safe_load(value) for key, value in (s.split("=", 1) for s in args.set)}}
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        rows.append(run_lever(name, known[name], base, args.work))
        print(json.dumps(rows[-1]), flush=True)

    first = rows[0]
    command = (f"`.venv/bin/python benchmarks/levers.py --base {args.base} --levers {args.levers} --work {args.work}"
               + "".join(f" --set {s}" for s in args.set) + "`")
    lines = [
        f"### levers — {datetime.now(UTC):%Y-%m-%d} — the {args.base} demo's base, eval τ on "
        f"{base['eval.prompts']} and the training log's walk, CPU",
        "",
        f"Command: {command}. Δ against the first lever ({first['lever']}).",
        "",
        "| lever | what it changes | data | train time | eval τ | Δ | log walk τ | Δ | lossless |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        walk_cells = (f"{r['walk']:.2f} | {r['walk'] - first['walk']:+.2f}"
                      if r["walk"] is not None and first["walk"] is not None else "– | –")
        lines.append(f"| {r['lever']} | {r['what']} | {r['data']} | {r['train_s'] / 60:.1f} min | {r['tau']:.2f} | "
                     f"{r['tau'] - first['tau']:+.2f} | {walk_cells} | {r['lossless']} |")
    record(lines, keep=not args.no_record)
    if args.json:
        print(json.dumps({"levers": rows}))


if __name__ == "__main__":
    main()

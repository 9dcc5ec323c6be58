"""Export a drafter in vLLM `speculators` format: a self-contained checkpoint (its `speculators_config` names
the verifier; embedding and LM head copied in) that `vllm serve DIR` and speculators' own classes load.

    flashdraft export --drafter work/train/drafter --target Qwen/Qwen3-8B --format speculators --out work/spec

The conversion is the speculators package's own DFlash converter (`speculators.convert.dflash`), run on
flashdraft's z-lab-format export: that package is the judge of its format, so flashdraft does not re-implement
it. speculators is not a flashdraft dependency (0.9 pins transformers ≤ 5.19): without it, one line says how
to get it. What flashdraft adds is what every stage has: the source must verify, the output is committed
with a manifest (its lineage names the source drafter), a rerun of a done export says so.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashdraft.artifact.manifest import Lineage, check_done, identity, read_manifest, require_verified, sha256_json
from flashdraft.artifact.ownership import commit_dir
from flashdraft.errors import BadInput, ExpectedFailure
from flashdraft.model.drafter_config import read_drafter_config
from flashdraft.model.staging import staged_model


def export_speculators(drafter_dir: Path, target_ref: str, out: Path, log: Callable[[str], None] = print
                       ) -> dict[str, Any]:
    from flashdraft.model.resolve import resolve_model

    drafter_dir, out = Path(drafter_dir), Path(out)
    drafter = read_drafter_config(drafter_dir)  # read once, checked: what the steps below are handed
    config = drafter.raw
    if config.get("architectures") == ["DFlash2DraftModel"]:
        raise BadInput("speculators 0.9 has a DFlash2 model class but no DFlash2 converter (its "
                       "speculators.convert.dflash writes DFlash only, and refuses the convolution and selector "
                       "tensors): serve the z-lab-format export, which SGLang and vLLM load as DFlash2DraftModel")
    if config.get("architectures") in (["Qwen3DSparkModel"], ["DSparkDraftModel"]):
        raise BadInput("speculators 0.9 has a DSpark model class but no DSpark converter (speculators.convert has "
                       "dflash, eagle and mtp only): serve the native export, which vLLM, SGLang and llama.cpp load as "
                       "DeepSpec's Qwen3DSparkModel")
    if config.get("draft_vocab_size"):
        raise BadInput("a reduced-vocabulary drafter cannot be written in speculators format: its DFlash converter "
                       "keeps the full vocabulary and drops d2t. Serve the z-lab export with vLLM (it reads d2t), "
                       "or train with the full vocabulary")
    try:
        from speculators.convert.dflash import DFlashConverter
    except ImportError:
        raise ExpectedFailure("the speculators format is written by the speculators package's own converter: "
                              "`pip install speculators` (0.9 needs transformers 5.0–5.19) and rerun") from None
    target = resolve_model(target_ref, log=log)
    lineage = Lineage(inputs=[identity(drafter_dir)],
                      config=sha256_json({"format": "speculators", "target": identity(target)}))
    decision = check_done(out, lineage)
    log(decision.line("export", out))
    if decision.done:
        return read_manifest(out).stats
    require_verified(drafter_dir, "drafter", "re-export it (rerun `flashdraft train`) or pull it again")
    stats = {"format": "speculators", "verifier": target}
    # The converter is third-party code: it sees allowlisted staging copies (model/staging.py: weights as
    # safetensors, JSON without auto_map, no Python file), never the directories as they are.
    with tempfile.TemporaryDirectory(prefix="flashdraft-speculators-stage-") as staging, \
            staged_model(Path(target), "target", Path(staging) / "target") as staged_target, \
            staged_model(drafter_dir, "drafter", Path(staging) / "drafter", config) as staged_drafter, \
            commit_dir(out, "drafter", stats=stats, lineage=lineage) as tmp:
        # The converter loads the verifier's embedding and LM head into the checkpoint, then reloads the result
        # with speculators' DFlashDraftModel (validate=True) before flashdraft commits it.
        DFlashConverter().convert(staged_drafter, tmp, base_model=str(staged_target), validate=True)
        named_as(tmp / "config.json", str(staged_target), target)  # its verifier is the target, not the copy
    log(f"export: speculators checkpoint written and verified at {out}")
    return stats


def named_as(config_path: Path, staged: str, real: str) -> None:
    """The written config with every string that names the staging copy naming the real directory instead (the
    converter records the verifier's path, and speculators loads the verifier's head from there)."""

    def renamed(value):
        if isinstance(value, dict):
            return {k: renamed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [renamed(v) for v in value]
        return value.replace(staged, real) if isinstance(value, str) else value

    config_path.write_text(json.dumps(renamed(json.loads(config_path.read_text())), indent=2) + "\n")

"""`flashdraft demo`: the embedded pipeline on one CPU machine, offline (DESIGN §3).

    flashdraft demo

Today it prepares the embedded target (SmolLM2-135M-Instruct, converted from the packaged GGUF into a
verified `model` artifact) and reports every stage's state honestly; stages join as they are built.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from flashdraft.config import EMBEDDED_TARGET
from flashdraft.models import resolve_model

PENDING_STAGES = ("generate", "tokenize", "train", "eval")


def run_demo(workdir: Path, console: Console) -> None:
    console.rule("flashdraft demo — embedded SmolLM2-135M-Instruct, CPU, offline")
    # resolve_model verifies the cached target (or rebuilds it and hashes what it wrote): checked now.
    target = Path(resolve_model(EMBEDDED_TARGET, log=console.print))

    table = Table(title="status (checked now)")
    table.add_column("stage")
    table.add_column("artifact")
    table.add_column("verified")
    table.add_row("target", str(target), "yes")
    for stage in PENDING_STAGES:
        table.add_row(stage, str(workdir / stage), "not built: stage not implemented yet")
    console.print(table)

"""Shared by the benchmark scripts: print a report and append it to benchmarks/RESULTS.md."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def record(lines: list[str], keep: bool = True) -> None:
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    if keep:
        existing = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
        RESULTS.write_text(existing.rstrip() + "\n\n" + report)

"""Rewrite tests/file_seconds.json from a pytest run's `--durations=0` output: each test file's seconds (setup, call
and teardown of its tests), which tests/conftest.py reads to hand the longest files to the workers first.

    .venv/bin/python -m pytest --durations=0 | tee suite.log
    .venv/bin/python scripts/suite_order.py suite.log
"""

import json
import re
import sys
from collections import Counter
from pathlib import Path

DURATION = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+?)::")


def main(log: str) -> None:
    seconds: Counter[str] = Counter()
    for line in Path(log).read_text().split("slowest durations", 1)[-1].splitlines():
        if found := DURATION.match(line):
            seconds[found.group(2)] += float(found.group(1))
    if not seconds:
        sys.exit(f"error: no durations in {log}: run pytest with --durations=0")
    out = Path(__file__).resolve().parents[1] / "tests" / "file_seconds.json"
    out.write_text(json.dumps({name: round(s, 1) for name, s in sorted(seconds.items())}, indent=1) + "\n")
    print(f"{out}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1])

"""The `flashdraft` command: thin wrappers over the stage modules (≤ 3 calls from a command to the work).

    flashdraft --help
    flashdraft verify DIR --json

Every command exits non-zero on failure. An expected failure (`flashdraft.errors.ExpectedFailure`: bad input,
a failed verification, an unreachable store) is one line on stderr and exit 1; anything else is a bug and keeps
its traceback. With `--json`, stdout holds only one JSON object; human-readable output goes to stderr.
"""

from __future__ import annotations

from flashdraft.cli.app import app

# Each module registers its commands on `app`; --help lists them in this order.
# isort: off
from flashdraft.cli import stages  # noqa: F401
from flashdraft.cli import artifacts  # noqa: F401
from flashdraft.cli import pipeline  # noqa: F401
# isort: on

__all__ = ["app"]

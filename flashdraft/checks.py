"""A preflight check, as every stage reports it: one line, `ok` with what was found, `FAIL` with why (naming the URL
or path, never a secret), or `skip` where it cannot be checked here (preflight.py, node_checks.py).

    checks = [guarded("disk at /data", lambda: "120.0 GB free")]; require(checks)
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flashdraft.errors import ExpectedFailure
from flashdraft.redact import redact


@dataclass(frozen=True)
class Check:
    what: str  # "store s3://bucket/run/generate", "endpoint http://gpu-a:8000/v1", …
    ok: bool
    detail: str  # what was found, or why it failed
    skipped: bool = False  # could not be checked here (said, not failed): printed "skip", never "ok"

    def line(self) -> str:
        state = "skip" if self.skipped else "ok  " if self.ok else "FAIL"
        return redact(f"{state} {self.what}: {self.detail}")


class PreflightFailed(ExpectedFailure):
    """A check before the work failed: nothing was started, nothing written."""


def require(checks: list[Check]) -> None:
    """Raise one line naming the first failed check (and how many others failed)."""
    failed = [c for c in checks if not c.ok]
    if failed:
        more = f" (and {len(failed) - 1} more check(s) failed: `flashdraft run … --dry-run` lists them)" \
            if len(failed) > 1 else ""
        raise PreflightFailed(redact(f"preflight: {failed[0].what}: {failed[0].detail}{more}; nothing was started"))


def guarded(what: str, check: Callable[[], str]) -> Check:
    """Run one check; an expected failure (or any error reaching a server) becomes its failed line."""
    try:
        return Check(what, True, check())
    except (ExpectedFailure, OSError, ValueError) as e:
        return Check(what, False, str(e))


def check_disk(where: str | Path, need_bytes: int) -> Check:
    def disk() -> str:
        existing = next(p for p in [Path(where).absolute(), *Path(where).absolute().parents] if p.exists())
        free = shutil.disk_usage(existing).free
        if free < need_bytes:
            raise ValueError(f"{free / 1e9:.1f} GB free, the estimate needs {need_bytes / 1e9:.1f} GB")
        return f"{free / 1e9:.1f} GB free, the estimate needs {need_bytes / 1e9:.1f} GB"

    return guarded(f"disk at {where}", disk)

"""The one base class for expected failures: bad input, a failed verification, an unreachable store.

The CLI prints an `ExpectedFailure` as one line (`error: …`) and exits 1. Anything else that escapes a command
is a bug, and keeps its traceback so it can be reported and fixed.
"""

from __future__ import annotations


class ExpectedFailure(Exception):
    """A failure the user can act on; the message says what is wrong and, where it helps, what to do."""


class BadInput(ExpectedFailure):
    """An input (file, directory, artifact, model reference, setting) that this stage cannot use."""


class BadTrainingInput(BadInput):
    """The dataset, target or settings cannot train a drafter; said before any compute."""


class WriteRefused(ExpectedFailure):
    """The disk refused a write (full, read-only, quota): nothing half-written is left for a later step."""


class Stopped(BaseException):
    """A stop signal (SIGTERM) raised where the command was, so that it unwinds through the same cleanup as an
    exception: the engines and processes it started are stopped, its temp files removed. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way can swallow it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name

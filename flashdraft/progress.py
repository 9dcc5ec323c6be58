"""One progress display for the long stages: a rich bar on a terminal; in a log file (stdout or stderr not a
terminal, as on a remote machine under nohup or a scheduler), one plain line at a steady interval with
done/total, rate and ETA, so hours of work are never silent.

with progress(console, "generate {task.fields[tps]} tok/s", total=n, tps="–") as update:
    update(advance=32, tps="412")

`FLASHDRAFT_PROGRESS_SECONDS` sets the interval of the plain lines (default 30).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class Pace:
    """How far the progress display now open has got, for a reader on another thread (the demo's heartbeat):
    done of total since `t0`, counting from `started_at` (work a rerun found done does not make a rate)."""

    def __init__(self, total: int | None, completed: int) -> None:
        self.total, self.done, self.started_at, self.t0 = total, completed, completed, time.monotonic()

    def seconds_left(self) -> float | None:
        """At the pace so far; None before the first unit of work (no pace yet) or without a total."""
        made, elapsed = self.done - self.started_at, time.monotonic() - self.t0
        if not self.total or made <= 0 or elapsed <= 0:
            return None
        return max(0, self.total - self.done) * elapsed / made


current: Pace | None = None  # the open progress display's pace (one at a time in a process)


@contextmanager
def progress(console, text: str, total: int | None = None, completed: int = 0, unit: str = "",
             **fields) -> Iterator[Callable]:
    """Yields `update(advance=0, **fields)`. With a total: bar, done/total, ETA; without: spinner, elapsed. `unit`
    names what is counted in the plain lines' rate ("2.10 turns/s")."""
    global current
    pace = current = Pace(total, completed)

    def counted(show: Callable) -> Callable:
        def update(advance: int = 0, **kw) -> None:
            pace.done += advance
            show(advance=advance, **kw)
        return update

    try:
        if console is None:
            yield counted(lambda advance=0, **kw: None)
        elif not console.is_terminal:
            yield counted(PlainLines(console, text, pace, fields, unit).update)
        else:
            if total is None:
                columns = (SpinnerColumn(), TextColumn(text), TimeElapsedColumn())
            else:
                columns = (TextColumn(text), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            with Progress(*columns, console=console) as bar:
                task = bar.add_task("", total=total, completed=completed, **fields)
                yield counted(lambda advance=0, **kw: bar.update(task, advance=advance, **kw))
    finally:
        if current is pace:
            current = None


class PlainLines:
    """The same progress as plain log lines, at most one per interval: "<text> 120/400 (30%), 2.1/s, ETA 2m13s"."""

    def __init__(self, console, text: str, pace: Pace, fields: dict, unit: str = "") -> None:
        self.console, self.text, self.pace, self.fields = console, text, pace, dict(fields)  # pace: counted by caller
        self.per_second = f" {unit}/s" if unit else "/s"
        self.interval = float(os.environ.get("FLASHDRAFT_PROGRESS_SECONDS", "30"))
        self.last = time.monotonic()

    def update(self, advance: int = 0, **fields) -> None:
        self.fields.update(fields)
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        self.last = now
        pace = self.pace
        task = SimpleNamespace(completed=pace.done, total=pace.total, fields=self.fields)
        rate = (pace.done - pace.started_at) / max(now - pace.t0, 1e-9)
        line = self.text.format(task=task)
        if pace.total:
            eta = pace.seconds_left()
            line += (f" {pace.done:,}/{pace.total:,} ({pace.done / pace.total:.0%}), {rate:,.2f}{self.per_second}, "
                     f"ETA {_duration(float('inf') if eta is None else eta)}")
        else:
            line += f" ({rate:,.2f}{self.per_second}, {_duration(now - pace.t0)} elapsed)"
        self.console.print(Text(line), soft_wrap=True, highlight=False)  # Text: never read as console markup


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def human_bytes(n: float) -> str:
    """A size as people read it: 185.3 MB, 53.8 GB (powers of 1000, as disks and bandwidths are sold)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")

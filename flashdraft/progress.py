"""One progress display for the long stages: a rich bar on a terminal, nothing elsewhere (logs stay clean).

with progress(console, "generate {task.fields[tps]} tok/s", total=n, tps="–") as update:
    update(advance=32, tps="412")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@contextmanager
def progress(console, text: str, total: int | None = None, completed: int = 0, **fields) -> Iterator[Callable]:
    """Yields `update(advance=0, **fields)`. With a total: bar, done/total, ETA; without: spinner, elapsed."""
    if console is None:
        yield lambda advance=0, **kw: None
        return
    if total is None:
        columns = (SpinnerColumn(), TextColumn(text), TimeElapsedColumn())
    else:
        columns = (TextColumn(text), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("", total=total, completed=completed, **fields)
        yield lambda advance=0, **kw: bar.update(task, advance=advance, **kw)

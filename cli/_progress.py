"""Progress bars for the long commands: on stderr, only when stderr is a terminal.

The library reports progress through plain callbacks, ``progress(done, total, what)``
(``profile_model``, ``make_plan``, ``verify_plan``); this module draws them with rich.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar(label: str, console: Console | None = None
                 ) -> Iterator[Callable[[int, int, str], None]]:
    """A transient bar named ``label``; yields the ``progress(done, total, what)`` callback.

    The bar is drawn on ``console`` (default: stderr) only when that is a terminal and
    this process is rank 0 (``RANK`` unset or ``0`` under torchrun), so pipes, logs and
    the other ranks see nothing. It is erased when the work ends.
    """
    console = console or Console(stderr=True)
    enabled = console.is_terminal and os.environ.get("RANK", "0") == "0"
    with Progress(TextColumn(f"[bold]{escape(label)}[/] {{task.description}}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True,
                  disable=not enabled) as bar:
        task_id = bar.add_task("", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task_id, completed=done, total=total, description=escape(what))

        yield progress

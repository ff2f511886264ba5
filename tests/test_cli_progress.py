"""Progress bars of the commands: drawn on a terminal, silent elsewhere and off rank 0."""

from __future__ import annotations

import io

from rich.console import Console

from cli._progress import progress_bar


def _run(console: Console) -> None:
    with progress_bar("searching", console) as progress:
        progress(1, 3, "1f1b v=1 m=2")
        progress(3, 3, "local [search]")


def test_draws_on_a_terminal():
    out = io.StringIO()
    _run(Console(file=out, force_terminal=True, width=100))
    text = out.getvalue()
    assert "searching" in text and "3/3" in text and "local [search]" in text


def test_silent_when_not_a_terminal():
    out = io.StringIO()
    _run(Console(file=out, force_terminal=False, width=100))
    assert out.getvalue() == ""


def test_silent_on_ranks_other_than_0(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    out = io.StringIO()
    _run(Console(file=out, force_terminal=True, width=100))
    assert out.getvalue() == ""

"""The docs cannot drift from the code: every documented command runs and prints what is shown.

``scripts/render_docs.py`` writes the output of every ```console block in README.md and
docs/*.md from a real run. This test runs each page's commands again, in order, in a fresh
directory, and checks that each exits 0 and that its first shown output line (its header:
a table title, a summary line; the last line where only a tail is shown) matches the
run's, digits masked, since times move.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts" / "render_docs.py")
render_docs = importlib.util.module_from_spec(spec)
sys.modules["render_docs"] = render_docs
spec.loader.exec_module(render_docs)

PAGES = [page for page in render_docs.pages() if render_docs.BLOCK.search(page.read_text())]


def _mask(line: str) -> str:
    """Digits and runs of spaces masked: timing-dependent figures and column widths."""
    return re.sub(r"\s+", " ", re.sub(r"\d+", "0", line)).strip()


def _header(lines: list[str]) -> str | None:
    """The first output line shown, or the last one when the page shows only a tail."""
    lines = [line for line in lines if line.strip()]
    if not lines:
        return None
    return lines[-1] if lines[0] == render_docs.MARK else lines[0]


def test_every_page_with_console_blocks_is_found():
    names = {page.name for page in PAGES}
    assert {"README.md", "profiling.md", "planning.md"} <= names


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_documented_commands_run_and_print_their_headers(page, tmp_path):
    text = page.read_text()
    for match in render_docs.BLOCK.finditer(text):
        for cmd, shown in render_docs.parse_block(match.group(1)):
            done = render_docs.run(cmd, str(tmp_path))
            output = done.stdout
            assert done.returncode == 0, f"{page.name}: `{cmd}` exited {done.returncode}:\n{output}"
            header = _header(shown)
            if header is not None:
                real = _header(render_docs.trim(
                    [render_docs.scrub(line, str(tmp_path)) for line in output.splitlines()],
                    shown))
                assert real is not None and _mask(real) == _mask(header), (
                    f"{page.name}: `{cmd}` printed {real!r}, the page shows {header!r}; "
                    "run scripts/render_docs.py")

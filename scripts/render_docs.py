"""Rewrite the output of every ```console block in README.md and docs/*.md from a real run.

In a ```console block, a line starting with ``$ `` is a command; the lines after it, up to
the next command, are its output. ``render_docs.py`` runs each page's commands in order,
in one fresh temporary directory per page (with ``examples/`` and ``benchmarks/`` linked
into it and it on ``PYTHONPATH``, so ``examples.tutorial_model:transformer`` and the like
resolve), and writes their combined stdout and stderr back in place.

Trimming rule: a command whose output in the page holds a line ``...`` keeps only the
lines the page shows before and after that marker: the first N lines of the real output
(N = lines before ``...``), the ``...`` line, and its last M lines (M = lines after).
Without a marker the whole output is written. ```bash blocks are shown, never run.

Usage: ``python scripts/render_docs.py [PAGE.md ...]`` (default: README.md and docs/*.md);
``--check`` runs the commands and exits 1 when a page would change (no file is written).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```console\n(.*?)^```\n", re.S | re.M)
MARK = "..."


def pages() -> list[Path]:
    """README.md and every docs/*.md page, in that order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse_block(body: str) -> list[tuple[str, list[str]]]:
    """Split a console block's text into (command, shown output lines) pairs."""
    items: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            items.append((line[2:], []))
        elif items:
            items[-1][1].append(line)
    return items


def commands(text: str) -> list[str]:
    """Every command of a page's console blocks, in page order."""
    return [cmd for m in BLOCK.finditer(text) for cmd, _ in parse_block(m.group(1))]


def run(cmd: str, cwd: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run one documented command in ``cwd``, the repository reachable, stderr into stdout."""
    # ``examples`` reachable by a link in ``cwd``, not the repository root on the path: that
    # would shadow the installed autopart with the checkout's, which lacks ``autopart.cli``
    # (mapped from ``cli/`` at install time).
    for name in ("examples", "benchmarks"):
        link = Path(cwd) / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=os.pathsep.join(
        [cwd, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run(cmd, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def scrub(line: str, workdir: str) -> str:
    """One output line as a page shows it: no work directory, the host named ``HOST``."""
    line = line.rstrip().replace(workdir + os.sep, "")
    return re.sub(rf"\b{re.escape(socket.gethostname())}\b", "HOST", line)


def trim(real: list[str], shown: list[str]) -> list[str]:
    """Apply the page's ``...`` marker: keep as many head and tail lines as it shows."""
    if MARK not in shown:
        return real
    head = shown.index(MARK)
    tail = len(shown) - head - 1
    if len(real) <= head + tail:
        return real
    return real[:head] + [MARK] + (real[len(real) - tail:] if tail else [])


def render(text: str, workdir: str, timeout: float = 600) -> str:
    """Return ``text`` with every console block's outputs replaced by a real run's."""
    def block(match: re.Match) -> str:
        out = []
        for cmd, shown in parse_block(match.group(1)):
            done = run(cmd, workdir, timeout)
            if done.returncode != 0:
                sys.exit(f"render_docs: `{cmd}` exited {done.returncode}:\n"
                         f"{done.stdout[-2000:]}")
            real = [scrub(line, workdir) for line in done.stdout.splitlines()]
            out += [f"$ {cmd}", *trim(real, shown)]
        return "```console\n" + "\n".join(out) + "\n```\n"
    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    """Render the given pages (default: all) in place, or check them with ``--check``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on a change")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds one command may take (default 600)")
    args = parser.parse_args(argv)
    changed = []
    for page in args.pages or pages():
        text = page.read_text()
        if not BLOCK.search(text):
            continue
        with tempfile.TemporaryDirectory() as workdir:
            new = render(text, workdir, args.timeout)
        if new != text:
            changed.append(page)
            if not args.check:
                page.write_text(new)
        print(f"{page}: {'changed' if new != text else 'unchanged'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())

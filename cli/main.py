"""Entry point of the ``autopart`` command (also ``python -m autopart``).

Each command lives in ``cli/cmd_<name>.py`` with ``add_parser(subparsers)`` and
``run(args) -> int``. The folder installs as ``autopart.cli`` (see pyproject.toml);
in a source checkout it is also importable as ``cli``, so commands import each
other relatively. User errors (``AutopartError``) print one line and exit 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from autopart.errors import AutopartError

# Command modules, in the order `autopart --help` lists them.
_COMMANDS = ("profile", "plan", "simulate", "verify", "calibrate")


def _load_commands(names: tuple[str, ...] = _COMMANDS) -> dict[str, object]:
    modules = {}
    for name in names:
        try:
            modules[name] = importlib.import_module(f".cmd_{name}", __package__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.cmd_{name}":
                raise
    return modules


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (exit 2) instead of usage + error."""

    def error(self, message: str) -> None:
        """Print ``prog: error: message; see --help`` and exit with code 2."""
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser(argv: list[str] | None = None
                 ) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The top-level parser with one subparser per available command.

    When ``argv`` names a command only that command's module is imported (``plan``
    on a profile needs neither torch nor transformers); else every command's is.
    """
    parser = _OneLineParser(
        prog="autopart",
        description="Automatic pipeline parallelism: profile, plan, simulate, run.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineParser)
    named = [arg for arg in (sys.argv[1:] if argv is None else argv) if arg in _COMMANDS]
    modules = _load_commands(tuple(named[:1]) or _COMMANDS)
    for module in modules.values():
        module.add_parser(sub)
    for command in sub.choices.values():  # also after the command: `autopart verify ... -v`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks on errors")
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log progress details")
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the process exit code."""
    parser, modules = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except AutopartError as exc:
        if args.debug:
            raise
        print(f"autopart {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the library did not foresee: still one line
        if args.debug:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"autopart {args.command}: error: {exc.strerror or exc}{where}; check the paths "
              f"given", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopart: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

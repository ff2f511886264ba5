"""``python -m autopart``: the same command line as ``autopart``."""

import sys

try:
    from autopart.cli.main import main
except ModuleNotFoundError as exc:
    # A source checkout run without an editable install: cli/ sits beside autopart/
    # (as profiles/ does, see autopart._data).
    if exc.name != "autopart.cli":
        raise
    from cli.main import main

sys.exit(main())

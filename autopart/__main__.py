"""``python -m autopart``: the same command line as ``autopart``."""

import sys

from cli.main import main

sys.exit(main())

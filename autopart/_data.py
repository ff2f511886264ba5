"""Where autopart's shipped data lives: ``profiles/`` (device specs, model presets).

Installed, ``profiles/`` is the package ``autopart._profiles``; in a source checkout
(tests run from the repository root) it is the ``profiles/`` folder beside
``autopart/``.
"""

from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

__all__ = ["data_path"]


def data_path(*parts: str) -> Traversable:
    """The shipped data file or folder ``profiles/<parts...>``."""
    try:
        root: Traversable = resources.files("autopart._profiles")
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parent.parent / "profiles"
    return root.joinpath(*parts)

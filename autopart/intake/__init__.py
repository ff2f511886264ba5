"""Intake: model source -> model on meta -> ordered chain of blocks, found from its forward."""

import importlib
from typing import Any

__all__ = ["BlockChain", "LoadedModel", "discover_blocks", "list_presets", "load_model"]

_HOMES = {"BlockChain": "chain", "discover_blocks": "blocks", "LoadedModel": "sources",
          "list_presets": "sources", "load_model": "sources"}


def __getattr__(name: str) -> Any:
    """Import torch-based intake only when used: shard-name helpers and planning need
    neither torch nor transformers."""
    if name in _HOMES:
        return getattr(importlib.import_module(f"autopart.intake.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

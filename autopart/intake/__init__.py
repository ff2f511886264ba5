"""Intake: model source -> model on meta -> ordered chain of blocks, found from its forward."""

from autopart.intake.blocks import BlockChain, discover_blocks
from autopart.intake.sources import LoadedModel, list_presets, load_model

__all__ = ["BlockChain", "LoadedModel", "discover_blocks", "list_presets", "load_model"]

"""Intake: model source -> model on meta -> ordered chain of blocks, found from its forward."""

from autopart.intake.blocks import Block, BlockChain, discover_blocks, example_inputs
from autopart.intake.hf import causal_lm_loss
from autopart.intake.sources import LoadedModel, list_presets, load_model

__all__ = [
    "Block",
    "BlockChain",
    "LoadedModel",
    "causal_lm_loss",
    "discover_blocks",
    "example_inputs",
    "list_presets",
    "load_model",
]

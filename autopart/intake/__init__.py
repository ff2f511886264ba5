"""Intake: model source -> model on meta -> ordered chain of blocks with original FQNs."""

from autopart.intake.blocks import Block, BlockChain, discover_blocks
from autopart.intake.hf import HFCausalLM, LayerContext, causal_lm_loss, init_rotary
from autopart.intake.sources import LoadedModel, list_presets, load_model

__all__ = [
    "Block",
    "BlockChain",
    "HFCausalLM",
    "LayerContext",
    "LoadedModel",
    "causal_lm_loss",
    "discover_blocks",
    "init_rotary",
    "list_presets",
    "load_model",
]

"""The Transformer of the PyTorch pipelining tutorial, as the tutorial writes it.

https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html defines this
model (only ``super().__init__()`` and the ``@dataclass`` the tutorial's listing
drops are restored). Its layers live in a ``ModuleDict`` called as ``layer(h, h)``,
and its forward tolerates deleted modules (``if self.norm``); autopart needs none
of that: it watches the forward and cuts between the calls.

Factories for ``autopart profile examples.tutorial_model:tiny_transformer``:
``transformer`` (the tutorial's sizes) and ``tiny_transformer`` (for a laptop CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class ModelArgs:
    """The tutorial's model sizes."""

    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    vocab_size: int = 10000


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` ``nn.TransformerDecoderLayer``, LayerNorm, output head."""

    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)

        # Using a ModuleDict lets us delete layers witout affecting names,
        # ensuring checkpoints will correctly save and load.
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(model_args.dim,
                                                                    model_args.n_heads)

        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor):
        """Logits ``[batch, seq, vocab]`` (fp32) for token ids ``[batch, seq]``."""
        # Handling layers being 'None' at runtime enables easy pipeline splitting
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens

        for layer in self.layers.values():
            h = layer(h, h)

        h = self.norm(h) if self.norm else h
        output = self.output(h).float() if self.output else h
        return output


TINY = ModelArgs(dim=64, n_layers=4, n_heads=4, vocab_size=1000)
"""Small enough to train on two CPU processes in seconds."""


def transformer() -> Transformer:
    """The tutorial's model at its own sizes (512 wide, 8 layers, 10k vocabulary)."""
    return Transformer(ModelArgs())


def tiny_transformer() -> Transformer:
    """The tutorial's model at ``TINY`` sizes."""
    return Transformer(TINY)

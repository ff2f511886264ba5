"""How each block of a chain is fed and called when it runs on its own.

* HF causal LMs (``HFRunner``): the embedding takes token ids (no input gradient),
  decoder layers take hidden states plus the layer context of
  ``autopart.intake.HFCausalLM`` (rotary embeddings, causal mask), then the final
  norm, then the head block, which is ``lm_head`` followed by ``causal_lm_loss``,
  so its backward starts from the loss. With tied embeddings the head block still
  counts the shared weight in its own ``param_bytes`` (a stage holding the head
  holds a copy); ``ModelInfo.num_params`` counts it once.
* Generic chains (``GenericRunner``, ``nn.Sequential`` / ``ModuleList`` models):
  each block takes the previous block's output (the first tensor if it returns a
  tuple). The first input is the model's ``autopart_example_input(micro_batch_size,
  seq_len)`` if it defines one, else token ids ``[mbs, seq]`` if the first block is
  (or starts with) an ``nn.Embedding``, else float ``[mbs, seq, in_features]`` with
  ``in_features`` the last dimension of the first parameter. The last block's loss
  is ``output.float().pow(2).mean()``.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autopart.errors import ProfileError
from autopart.intake import (
    Block,
    BlockChain,
    HFCausalLM,
    LayerContext,
    causal_lm_loss,
    init_rotary,
)

__all__ = ["BlockTask", "GenericRunner", "HFRunner", "make_runner"]


@dataclass(slots=True)
class BlockTask:
    """One materialized block, its input and how to call it."""

    run: Callable[[torch.Tensor], torch.Tensor]
    """Forward from the block input to its output (to the loss for the last block)."""
    inputs: torch.Tensor
    """The block input: a leaf that requires grad iff ``input_grad``."""
    input_grad: bool
    """Whether the backward computes a gradient for the input (B > 0)."""
    loss_output: bool
    """The output is a scalar loss: backward starts from it with no incoming gradient."""
    module: nn.Module
    exclude: tuple[torch.Tensor, ...] = ()
    """Tensors that are not activations of this block (shared layer context)."""

    def forward(self) -> torch.Tensor:
        """Run the block's forward once."""
        return self.run(self.inputs)

    def trainable(self) -> list[torch.Tensor]:
        """Parameters that receive gradients."""
        return [p for p in self.module.parameters() if p.requires_grad]


class HFRunner:
    """Feeds and calls the blocks of an HF causal LM one at a time."""

    def __init__(self, model: nn.Module, chain: BlockChain, device: torch.device,
                 dtype: torch.dtype, micro_batch_size: int, seq_len: int) -> None:
        self.config = model.config
        self.device, self.dtype = device, dtype
        self.num_layers = len(model.model.layers)
        rotary = copy.deepcopy(model.model.rotary_emb)
        self.shell = types.SimpleNamespace(
            config=model.config, lm_head=None,
            model=types.SimpleNamespace(rotary_emb=rotary, layers=[None] * self.num_layers))
        init_rotary(self.shell, device)
        self.adapter = HFCausalLM(self.shell)
        shape = (micro_batch_size, seq_len)
        self.ids = torch.randint(0, self.config.vocab_size, shape, device=device)
        self.labels = torch.randint(0, self.config.vocab_size, shape, device=device)
        self._ctx = None

    def first_input(self) -> torch.Tensor:
        """Token ids for the embedding."""
        return self.ids

    def signature_extra(self, block: Block) -> str:
        """The attention type of a decoder layer (full / sliding) makes blocks differ."""
        if block.kind == "decoder_layer":
            return self.adapter.layer_type(_layer_idx(block))
        return ""

    def task(self, block: Block, module: nn.Module, inputs: torch.Tensor) -> BlockTask:
        """The task running ``module`` (a materialized copy of ``block``) on ``inputs``."""
        if block.kind == "embedding":
            return BlockTask(run=module, inputs=inputs.detach(), input_grad=False,
                             loss_output=False, module=module)
        x = inputs.detach().requires_grad_(True)
        if block.kind == "decoder_layer":
            idx = _layer_idx(block)
            self.shell.model.layers = [None] * self.num_layers  # drop the previous block
            self.shell.model.layers[idx] = module
            ctx = self._context(x)
            shared = (ctx.position_ids, *ctx.position_embeddings,
                      *[m for m in ctx.masks.values() if m is not None])
            return BlockTask(run=lambda h: self.adapter.layer(idx, h, ctx), inputs=x,
                             input_grad=True, loss_output=False, module=module, exclude=shared)
        if block.kind == "head":
            labels = self.labels
            return BlockTask(run=lambda h: causal_lm_loss(module(h), labels), inputs=x,
                             input_grad=True, loss_output=True, module=module)
        return BlockTask(run=module, inputs=x, input_grad=True, loss_output=False, module=module)

    def _context(self, hidden: torch.Tensor) -> LayerContext:
        if self._ctx is None:
            with torch.no_grad():
                self._ctx = self.adapter.context(hidden.detach())
        return self._ctx


class GenericRunner:
    """Feeds each block of a generic chain the previous block's output."""

    def __init__(self, model: nn.Module, chain: BlockChain, device: torch.device,
                 dtype: torch.dtype, micro_batch_size: int, seq_len: int) -> None:
        self.model, self.chain = model, chain
        self.device, self.dtype = device, dtype
        self.shape = (micro_batch_size, seq_len)
        self.last = chain.blocks[-1].name

    def first_input(self) -> torch.Tensor:
        """The first block's input (see the module docstring)."""
        example = getattr(self.model, "autopart_example_input", None)
        if callable(example):
            return self._from_example(example(*self.shape))
        first = self.model.get_submodule(self.chain.blocks[0].name)
        owner = next((m for m in first.modules() if any(True for _ in m.parameters(False))), None)
        if isinstance(owner, nn.Embedding):
            return torch.randint(0, owner.num_embeddings, self.shape, device=self.device)
        param = next(first.parameters(), None)
        if param is None or param.dim() == 0:
            raise ProfileError(f"cannot infer the input of block {self.chain.blocks[0].name!r}; "
                               f"define model.autopart_example_input(micro_batch_size, seq_len)")
        return torch.randn(*self.shape, param.shape[-1], device=self.device, dtype=self.dtype)

    def signature_extra(self, block: Block) -> str:
        """Generic blocks differ only by structure and input."""
        return ""

    def task(self, block: Block, module: nn.Module, inputs: torch.Tensor) -> BlockTask:
        """The task running ``module`` on the previous output ``inputs``."""
        grad = inputs.is_floating_point()
        x = inputs.detach().requires_grad_(grad)
        if block.name == self.last:
            return BlockTask(run=lambda t: _first_tensor(module(t)).float().pow(2).mean(),
                             inputs=x, input_grad=grad, loss_output=True, module=module)
        return BlockTask(run=lambda t: _first_tensor(module(t)), inputs=x, input_grad=grad,
                         loss_output=False, module=module)

    def _from_example(self, example: object) -> torch.Tensor:
        if not isinstance(example, torch.Tensor):
            raise ProfileError(f"autopart_example_input returned {type(example).__name__}, "
                               f"expected one tensor")
        if example.is_meta and self.device.type != "meta":
            example = (torch.randn(example.shape, dtype=example.dtype)
                       if example.is_floating_point() else torch.zeros(example.shape,
                                                                       dtype=example.dtype))
        if example.is_floating_point():
            example = example.to(self.dtype)
        return example.to(self.device)


def make_runner(model: nn.Module, chain: BlockChain, device: torch.device, dtype: torch.dtype,
                micro_batch_size: int, seq_len: int) -> HFRunner | GenericRunner:
    """The runner for ``chain``'s family."""
    cls = HFRunner if chain.family == "hf_causal_lm" else GenericRunner
    return cls(model, chain, device, dtype, micro_batch_size, seq_len)


def _layer_idx(block: Block) -> int:
    return int(block.name.rsplit(".", 1)[1])


def _first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise ProfileError(f"a block returned {type(out).__name__} with no tensor in it")

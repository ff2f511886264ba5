"""The calling convention of HF decoder-only causal LMs, one block at a time.

``LlamaModel.forward`` cannot run on meta (mask code calls ``Tensor.item()``) and
does not tolerate missing modules, so the profiler and the runtime call the
blocks themselves: embedding, decoder layers (with ``position_embeddings`` from
``rotary_emb`` and the causal/padding masks), final norm, head, loss. Original
FQNs are kept throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HFCausalLM", "LayerContext", "causal_lm_loss", "init_rotary"]

IGNORE_INDEX = -100


@dataclass(slots=True)
class LayerContext:
    """What every decoder layer needs besides the hidden states."""

    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    masks: dict[str, torch.Tensor | None]
    """Attention mask per layer type (``full_attention``, ``sliding_attention``)."""


class HFCausalLM:
    """Calls the blocks of an HF causal LM (``model.model.*`` and ``lm_head``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.backbone = model.model

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> hidden states."""
        return self.backbone.embed_tokens(input_ids)

    def context(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> LayerContext:
        """Position ids, rotary embeddings and masks for a batch of ``hidden`` states.

        ``attention_mask`` is the usual 2-D padding mask (1 = token, 0 = pad) or
        ``None``; position ids default to ``0 .. seq_len - 1``.
        """
        seq_len = hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
        rotary = self.backbone.rotary_emb
        position_embeddings = rotary(hidden, position_ids)
        return LayerContext(position_ids=position_ids, position_embeddings=position_embeddings,
                            masks=self._masks(hidden, attention_mask, position_ids))

    def layer(self, idx: int, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """Run decoder layer ``idx``."""
        out = self.backbone.layers[idx](
            hidden, attention_mask=ctx.masks[self.layer_type(idx)],
            position_embeddings=ctx.position_embeddings, position_ids=ctx.position_ids,
            past_key_values=None, use_cache=False,
        )
        return out[0] if isinstance(out, tuple) else out

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm."""
        return self.backbone.norm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection to vocabulary logits."""
        return self.model.lm_head(hidden)

    def layer_type(self, idx: int) -> str:
        """``full_attention`` or ``sliding_attention`` for layer ``idx``."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return layer_types[idx]
        if getattr(self.config, "sliding_window", None) and getattr(
                self.config, "use_sliding_window", True):
            return "sliding_attention"
        return "full_attention"

    def _masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
        types = {self.layer_type(i) for i in range(len(self.backbone.layers))}
        if hidden.device.type == "meta":
            # SDPA's causal path needs no mask tensor; HF's mask code cannot run on meta.
            assert attention_mask is None, "padding masks are not supported on meta"
            return {t: None for t in types}
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        kwargs = {"config": self.config, "inputs_embeds": hidden,
                  "attention_mask": attention_mask, "past_key_values": None,
                  "position_ids": position_ids}
        makers = {"full_attention": create_causal_mask,
                  "sliding_attention": create_sliding_window_causal_mask}
        return {t: makers[t](**kwargs) for t in types}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   num_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross entropy; positions labelled -100 are ignored.

    With ``num_tokens`` the summed loss is divided by it (so microbatch losses add
    up to the full batch's mean); otherwise the mean over this batch's tokens.
    """
    shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    if num_tokens is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / num_tokens


def init_rotary(model: nn.Module, device: torch.device | str) -> None:
    """Recompute the rotary embedding buffers on ``device`` (after ``to_empty``)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return
    with torch.device(device):
        fresh = type(rotary)(config=rotary.config)
    for name, buf in fresh.named_buffers(recurse=False):
        rotary.register_buffer(name, buf, persistent=False)
    rotary.attention_scaling = fresh.attention_scaling

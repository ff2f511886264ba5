"""What a profile says about the model itself (``ModelInfo``): sizes, layout, notes."""

from __future__ import annotations

from torch import nn

from autopart.intake import BlockChain, LoadedModel
from autopart.intake.head_split import head_split_refusal
from autopart.profile.slice_checks import SliceChecks
from autopart.runtime.aux_loss import router_loss_spec
from autopart.schema import BlockProfile, ModelInfo

__all__ = []


def model_notes(model: nn.Module, chain: BlockChain, blocks: list[BlockProfile]) -> list[str]:
    """The one-line notes of ``ModelInfo.notes`` for a profiled model."""
    notes = []
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "eager" and \
            not getattr(model, "_supports_sdpa", True):
        notes.append(f"attention: eager; transformers has no SDPA attention for "
                     f"{config.model_type}, so it is profiled and trained with eager")
    notes.extend(chain.notes)
    head = chain.blocks[-1]
    why = _head_refusal(model, chain) if chain.family == "hf_causal_lm" and \
        head.kind == "head" and not head.modules else None
    if why is not None:
        notes.append(f"head: kept whole (never cut by vocabulary): {why}")
    if chain.granularity == "projection":
        notes.append("projection: decoder layer halves are split before their output "
                     "projection where exact (attention up to o_proj, o_proj, MLP up to "
                     "down_proj, down_proj in Llama-like layers); the residual crosses those "
                     "cuts too")
    if chain.granularity == "half":
        notes.append("half: each decoder layer is two blocks, its attention half and its "
                     "MLP half, each named by its last module (a cut falls after it)")
    for block in chain.blocks:
        if block.modules and not block.layer:
            notes.append(f"block {block.name} runs {' + '.join(block.modules)}: the forward "
                         f"uses them together, so no exact cut separates them")
    loads = [b.expert_load for b in blocks if b.expert_load]
    if loads:
        notes.append(f"MoE routing over {len(loads)} layers: the busiest expert got "
                     f"{max(x[0] for x in loads):.2f}x the mean tokens, the idlest "
                     f"{min(x[1] for x in loads):.2f}x (random weights; a trained router differs)")
    if router_loss_spec(model) is not None:
        notes.append(f"router auxiliary loss (router_aux_loss_coef={config.router_aux_loss_coef}"
                     f"): the stages add their layers' shares exactly, after a forward-only "
                     f"pass per step that counts the whole batch's routing (a whole step under "
                     f"split-backward schedules); plans price that pass on top of the blocks")
    return notes


def model_info(loaded: LoadedModel, chain: BlockChain, blocks: list[BlockProfile],
               slices: SliceChecks | None = None) -> ModelInfo:
    """The profile's ``ModelInfo``: sizes from the config, the chain's layout, the notes,
    and the half kinds ``slices`` found can be cut inside their call."""
    config = loaded.config
    hf = chain.family == "hf_causal_lm" and config is not None
    num_layers = sum(1 for b in chain.blocks if b.kind == "decoder_layer")
    if chain.granularity != "layer":
        num_layers = len({b.layer for b in chain.blocks if b.layer})
    elif not hf:
        num_layers = sum(1 for b in chain.blocks if b.class_name in chain.layer_class_names)
    return ModelInfo(
        name=loaded.name, fingerprint=chain.fingerprint,
        num_params=sum(p.numel() for p in loaded.model.parameters()), source=loaded.source,
        family=getattr(config, "model_type", chain.family) if hf else chain.family,
        tied_embeddings=chain.tied_embeddings,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0) if hf else 0,
        hidden_size=int(getattr(config, "hidden_size", 0) or 0) if hf else 0,
        num_layers=num_layers, layer_classes=chain.layer_class_names,
        shared_modules=chain.shared_modules,
        head_split_rows=_head_split_rows(loaded.model, chain),
        router_loss_pass=hf and router_loss_spec(loaded.model) is not None,
        slice_units=slices.units() if slices is not None else {},
        slice_modules=slices.modules() if slices is not None else {},
        notes=tuple(model_notes(loaded.model, chain, blocks)
                    + (slices.notes() if slices is not None else [])))


def _head_split_rows(model: nn.Module, chain: BlockChain) -> int:
    """Rows of the head's weight if the runtime can split the head by vocabulary, else 0."""
    head = chain.blocks[-1]
    if (chain.family != "hf_causal_lm" or head.kind != "head" or head.modules
            or _head_refusal(model, chain) is not None):
        return 0
    return int(model.get_submodule(head.name).weight.shape[0])


def _head_refusal(model: nn.Module, chain: BlockChain) -> str | None:
    """Why the causal LM's head block cannot be split by vocabulary (``head_split_refusal``
    with what the watched forward did to its output), or ``None``."""
    return head_split_refusal(model, chain.blocks[-1].name, chain.trace)

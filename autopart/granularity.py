"""Plan a ``sublayer`` profile at ``layer`` granularity: fuse each layer's two halves.

A profile taken with ``--granularity sublayer`` names every decoder layer's halves
(``BlockProfile.layer``). Tools that cut only between whole layers (the NxD and
Megatron exports, the public baselines) plan on the fused profile: one
``decoder_layer`` block per layer, named by the layer's FQN, with the halves'
times, parameters and activations summed. The fingerprint is unchanged (it never
depends on granularity), so the runtime accepts plans of either granularity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from autopart.schema import BlockProfile, Profile

__all__ = ["fuse_halves", "fuse_layers", "fuse_quarters", "layer_groups"]


def layer_groups(blocks: Sequence[BlockProfile]) -> list[list[int]]:
    """Indices of ``blocks`` grouped so that each layer's halves form one group.

    Args:
        blocks: a profile's blocks, any granularity.

    Returns:
        One list of consecutive indices per unit: ``[i]`` for a block outside the
        decoder layers (or a whole layer), ``[i, i + 1]`` for a layer's two halves.
    """
    groups: list[list[int]] = []
    for i, block in enumerate(blocks):
        if groups and block.layer and blocks[groups[-1][-1]].layer == block.layer:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def fuse_halves(halves: Sequence[BlockProfile], class_name: str = "") -> BlockProfile:
    """One ``decoder_layer`` block from a layer's halves (times, bytes and counts summed).

    Args:
        halves: the consecutive blocks of one layer (a single block is returned as is).
        class_name: the layer's class (``LlamaDecoderLayer``), if known.

    Returns:
        The fused block: named by the layer, output bytes of the last half, the
        largest transient, ``reused_from`` the layer whose halves were reused.
    """
    if len(halves) == 1 and not halves[0].layer:
        return halves[0]
    last = halves[-1]
    twins = {h.reused_from.rsplit(".", 1)[0] if h.reused_from else None for h in halves}
    twin = next(iter(twins)) if len(twins) == 1 else None
    return BlockProfile(
        name=last.layer, kind="decoder_layer", class_name=class_name,
        fwd_ms=sum(h.fwd_ms for h in halves), bwd_ms=sum(h.bwd_ms for h in halves),
        bwd_input_ms=sum(h.bwd_input_ms for h in halves),
        bwd_weight_ms=sum(h.bwd_weight_ms for h in halves),
        param_bytes=sum(h.param_bytes for h in halves),
        activation_bytes=sum(h.activation_bytes for h in halves),
        held_for_weight_bytes=sum(h.held_for_weight_bytes for h in halves),
        output_bytes=last.output_bytes,
        transient_bytes=max(h.transient_bytes for h in halves),
        adopted_grad_bytes=max(h.transient_bytes for h in halves)
        - max(h.transient_bytes - h.adopted_grad_bytes for h in halves),
        num_params=sum(h.num_params for h in halves),
        fwd_ms_spread=max(h.fwd_ms_spread for h in halves),
        bwd_ms_spread=max(h.bwd_ms_spread for h in halves),
        measured=halves[0].measured, compile_ms=sum(h.compile_ms for h in halves),
        reused_from=twin if twin != last.layer else None,
        expert_load=next((h.expert_load for h in halves if h.expert_load), ()))


def fuse_layers(profile: Profile) -> Profile:
    """``profile`` at ``layer`` granularity (itself when it already is).

    Args:
        profile: a profile of either granularity.

    Returns:
        The profile with each layer's halves fused into one ``decoder_layer`` block
        and ``setup.granularity == "layer"``. The glue between halves (the residual
        add after attention) is in neither half, so a fused layer can be ~1-2%
        faster than one profiled whole.
    """
    if profile.setup.granularity == "layer":
        return profile
    classes = profile.model.layer_classes
    class_name = classes[0] if len(classes) == 1 else ""
    blocks = tuple(fuse_halves([profile.blocks[i] for i in group], class_name)
                   for group in layer_groups(profile.blocks))
    return replace(profile, blocks=blocks, setup=replace(profile.setup, granularity="layer"))


def fuse_quarters(profile: Profile) -> Profile:
    """``profile`` at ``sublayer`` granularity (itself unless it is ``quarter``).

    Args:
        profile: a profile of any granularity.

    Returns:
        The profile with the two parts of every split half (``autopart.intake.inner``:
        the half up to its output projection, the projection) fused into the half,
        named as a ``sublayer`` profile names it, and ``setup.granularity ==
        "sublayer"``.
    """
    if profile.setup.granularity != "quarter":
        return profile
    blocks: list[BlockProfile] = []
    for block in profile.blocks:
        prev = blocks[-1] if blocks else None
        if prev is None or not block.layer or (prev.layer, prev.kind) != (block.layer,
                                                                          block.kind):
            blocks.append(block)
            continue
        first = block.modules[0] if block.modules else block.name
        parent = first.rsplit(".", 1)[0]  # the half's module P, C's parent
        modules = [m for m in (prev.modules or (prev.name,))
                   if not m.startswith(parent + ".")] + [parent, *block.modules[1:]]
        fused = fuse_halves([prev, block])
        blocks[-1] = replace(fused, name=modules[-1], kind=block.kind, layer=block.layer,
                             modules=tuple(modules), class_name="",
                             reused_from=fused.reused_from if fused.reused_from
                             != modules[-1] else None)
    return replace(profile, blocks=tuple(blocks),
                   setup=replace(profile.setup, granularity="sublayer"))

"""Tensor- and data-parallel costs: a profile sharded for TP, and ring collective times.

Pure functions beside ``autopart.cost``: the mesh search (``autopart.solve.mesh``)
shards a profile with ``shard_profile`` and hands it to the pipeline search unchanged.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence parallelism,
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") on ``tp`` devices of one node:

- parameters, gradients and optimizer state of embeddings, decoder layers and the
  head are split ``tp`` ways; norms are replicated;
- compute per shard: the block's time / tp, divided by ``TP_EFFICIENCY`` (GEMMs ``tp``
  times narrower run below the full-size efficiency: an assumption, not a measurement;
  ``autopart verify`` calibrates it away). Without sequence parallelism the norms and
  residual adds run whole on every shard: there a profile of the shard itself is used
  where there is one (the analytical backend on the config with heads, intermediate
  size and vocabulary / tp, ``autopart.profile.tp_shard``). Under sequence parallelism
  every op of a layer is split, and an analytical (roofline) shard is exactly 1 / tp of
  the block, so the scaled figure is used; the shard profile still gives the exact
  parameter count (key-value heads replicated when fewer than tp);
- activations: with sequence parallelism everything a layer keeps is split; without,
  Korthikanti et al.'s per-layer count ``sbh (10 + 24 / tp)`` of ``sbh * 34`` is used
  (the layer-norm and dropout inputs stay whole);
- collectives per block over the intra-node link, all of the hidden-state size
  ``b * s * h``: a decoder layer does two all-reduces in the forward (after attention
  and after the MLP) and two in the backward, each of its halves one each way; the
  vocabulary-parallel embedding one in the forward; the vocabulary-parallel head one
  each way. Sequence parallelism turns
  each all-reduce into a reduce-scatter plus an all-gather: the same ring time. They
  are not overlapped with compute (Megatron's default).
"""

from __future__ import annotations

import dataclasses

from autopart.schema import BlockProfile, Profile

__all__ = ["TP_COLLECTIVES", "TP_EFFICIENCY", "ring_all_gather_ms", "ring_all_reduce_ms",
           "shard_profile", "tp_comm_ms_per_block"]

TP_EFFICIENCY = 0.9
"""Compute efficiency of a TP shard relative to the whole block (stated assumption)."""

TP_COLLECTIVES = {"decoder_layer": (2, 2), "block": (2, 2), "attention": (1, 1),
                  "mlp": (1, 1), "embedding": (1, 0), "head": (1, 1), "norm": (0, 0)}
"""All-reduces of the hidden state per block kind: (forward, backward)."""

_LAYER_KINDS = ("decoder_layer", "block", "attention", "mlp")
_REPLICATED_ACTIVATION = 10 / 34
"""Share of a layer's saved activations that TP without sequence parallelism keeps whole."""


def ring_all_reduce_ms(num_bytes: float, num_ranks: int, bandwidth_bytes_per_s: float,
                       latency_ms: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``num_ranks`` devices.

    ``2 (n - 1)`` steps of ``bytes / n`` each: ``2 (n-1)/n * bytes / bw + 2 (n-1) * latency``.

    Args:
        num_bytes: The buffer each rank holds.
        num_ranks: Devices in the ring.
        bandwidth_bytes_per_s: Per-device link bandwidth, one direction.
        latency_ms: Cost of one ring step.

    Returns:
        Milliseconds; 0 for one rank or an empty buffer.
    """
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    steps = 2 * (num_ranks - 1)
    return steps * latency_ms + 1e3 * steps / num_ranks * num_bytes / bandwidth_bytes_per_s


def ring_all_gather_ms(num_bytes: float, num_ranks: int, bandwidth_bytes_per_s: float,
                       latency_ms: float) -> float:
    """Ring all-gather (or reduce-scatter) whose full buffer is ``num_bytes``: half an
    all-reduce, ``(n-1)/n * bytes / bw + (n-1) * latency``."""
    return ring_all_reduce_ms(num_bytes, num_ranks, bandwidth_bytes_per_s, latency_ms) / 2


def tp_comm_ms_per_block(profile: Profile, tp: int, bandwidth_bytes_per_s: float,
                         latency_ms: float) -> list[tuple[float, float]]:
    """TP collective time of each block for one microbatch: (forward, backward) ms.

    The hidden state is the block's input (the previous block's output), or its own
    output for the first block.

    Args:
        profile: The unsharded profile.
        tp: Tensor-parallel degree.
        bandwidth_bytes_per_s: Intra-node link bandwidth per device.
        latency_ms: Intra-node per-step latency.

    Returns:
        One (forward, backward) pair per block.
    """
    out = []
    for i, block in enumerate(profile.blocks):
        hidden = profile.blocks[i - 1].output_bytes if i > 0 else block.output_bytes
        one = ring_all_reduce_ms(hidden, tp, bandwidth_bytes_per_s, latency_ms)
        num_fwd, num_bwd = TP_COLLECTIVES[block.kind]
        out.append((num_fwd * one, num_bwd * one))
    return out


def shard_profile(profile: Profile, tp: int, *, bandwidth_bytes_per_s: float,
                  latency_ms: float, sequence_parallel: bool = True,
                  shard: Profile | None = None) -> Profile:
    """The profile of one TP shard: what each of ``tp`` devices computes and holds.

    Args:
        profile: The unsharded profile (one device per stage).
        tp: Tensor-parallel degree (1 returns ``profile`` itself).
        bandwidth_bytes_per_s: Intra-node link bandwidth per device.
        latency_ms: Intra-node per-step latency.
        sequence_parallel: Megatron's sequence parallelism (activations all split).
        shard: A profile of one shard itself (``autopart.profile.tp_shard``: the
            analytical backend on the config with heads, intermediate size and vocabulary
            / tp), same blocks in the same order. Its parameters and transient bytes
            replace the scaled ones, and without sequence parallelism its compute times
            and activations too; else times scale by ``1 / (tp * TP_EFFICIENCY)``.

    Returns:
        The same blocks (same names, same fingerprint) with times including the TP
        collectives, and parameters, activations, boundary and transient bytes of one
        shard; a model note says how it was derived.
    """
    if tp == 1:
        return profile
    comm = tp_comm_ms_per_block(profile, tp, bandwidth_bytes_per_s, latency_ms)
    whole = _REPLICATED_ACTIVATION
    act_share = 1 / tp if sequence_parallel else whole + (1 - whole) / tp
    blocks = []
    shards = profile.blocks if shard is None else shard.blocks
    for block, part, (comm_fwd, comm_bwd) in zip(profile.blocks, shards, comm, strict=True):
        share = act_share if block.kind in _LAYER_KINDS else 1 / tp
        if block.kind == "norm" and not sequence_parallel:
            share = 1.0
        out = _scaled(block, tp, share, comm_fwd, comm_bwd)
        if shard is not None:
            out = dataclasses.replace(out, num_params=part.num_params,
                                      param_bytes=part.param_bytes,
                                      transient_bytes=part.transient_bytes,
                                      adopted_grad_bytes=part.adopted_grad_bytes)
        if shard is not None and not sequence_parallel:
            out = dataclasses.replace(
                out, fwd_ms=part.fwd_ms + comm_fwd, bwd_input_ms=part.bwd_input_ms + comm_bwd,
                bwd_weight_ms=part.bwd_weight_ms, bwd_ms=part.bwd_ms + comm_bwd,
                activation_bytes=part.activation_bytes)
        blocks.append(out)
    how = f"block times / {tp} / {TP_EFFICIENCY} (shard efficiency, assumed)"
    if shard is not None and not sequence_parallel:
        how = ("block times of the shard's own analytical profile (heads, intermediate size "
               "and vocabulary / tp; norms and residual adds whole)")
    how += ", parameters of the shard's own profile" if shard is not None else \
        f", parameters / {tp} (norms whole)"
    acts = f"/ {tp}" if sequence_parallel else "as without sequence parallelism"
    note = (f"tensor parallel {tp}: {how}, plus ring all-reduces of the hidden state; "
            f"activations {acts}")
    model = dataclasses.replace(profile.model, notes=(*profile.model.notes, note))
    return dataclasses.replace(profile, model=model, blocks=tuple(blocks))


def _scaled(block: BlockProfile, tp: int, share: float, comm_fwd: float,
            comm_bwd: float) -> BlockProfile:
    """One block's shard by scaling: compute / (tp * efficiency); parameters, their
    gradients in the workspace, the workspace and what crosses a cut / tp; saved
    activations and the gradients held from B to W by ``share``. Every byte field scales,
    so a shard's figures keep the schema's relations (adopted gradients within the
    workspace)."""
    scale = 1 / (tp * TP_EFFICIENCY)
    split = block.kind != "norm"
    bwd_input = block.bwd_input_ms * scale + comm_bwd
    bwd_weight = block.bwd_weight_ms * scale
    return dataclasses.replace(
        block, fwd_ms=block.fwd_ms * scale + comm_fwd, bwd_input_ms=bwd_input,
        bwd_weight_ms=bwd_weight, bwd_ms=bwd_input + bwd_weight,
        num_params=-(-block.num_params // tp) if split else block.num_params,
        param_bytes=-(-block.param_bytes // tp) if split else block.param_bytes,
        activation_bytes=round(block.activation_bytes * share),
        held_for_weight_bytes=round(block.held_for_weight_bytes * share),
        output_bytes=-(-block.output_bytes // tp),
        transient_bytes=-(-block.transient_bytes // tp),
        adopted_grad_bytes=min(-(-block.adopted_grad_bytes // tp) if split
                               else block.adopted_grad_bytes, -(-block.transient_bytes // tp)),
        measured=())

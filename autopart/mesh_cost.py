"""Tensor- and data-parallel costs: a profile sharded for TP, and ring collective times.

Pure functions beside ``autopart.cost``: the mesh search (``autopart.solve.mesh``)
shards a profile with ``shard_profile`` and hands it to the pipeline search unchanged.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence parallelism,
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") on ``tp`` devices of one node:

- parameters, gradients and optimizer state of embeddings, decoder layers and the
  head are split ``tp`` ways; norms are replicated;
- compute per shard is the block's time / tp, divided by ``TP_EFFICIENCY`` (GEMMs
  ``tp`` times narrower run below the full-size efficiency: an assumption, not a
  measurement; ``autopart verify`` calibrates it away);
- activations: with sequence parallelism everything a layer keeps is split; without,
  Korthikanti et al.'s per-layer count ``sbh (10 + 24 / tp)`` of ``sbh * 34`` is used
  (the layer-norm and dropout inputs stay whole);
- collectives per block over the intra-node link, all of the hidden-state size
  ``b * s * h``: a decoder layer does two all-reduces in the forward (after attention
  and after the MLP) and two in the backward; the vocabulary-parallel embedding one in
  the forward; the vocabulary-parallel head one each way. Sequence parallelism turns
  each all-reduce into a reduce-scatter plus an all-gather: the same ring time. They
  are not overlapped with compute (Megatron's default).
"""

from __future__ import annotations

import dataclasses

from autopart.schema import Profile

__all__ = ["TP_COLLECTIVES", "TP_EFFICIENCY", "ring_all_gather_ms", "ring_all_reduce_ms",
           "shard_profile", "tp_comm_ms_per_block"]

TP_EFFICIENCY = 0.9
"""Compute efficiency of a TP shard relative to the whole block (stated assumption)."""

TP_COLLECTIVES = {"decoder_layer": (2, 2), "block": (2, 2), "embedding": (1, 0),
                  "head": (1, 1), "norm": (0, 0)}
"""All-reduces of the hidden state per block kind: (forward, backward)."""

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
                  latency_ms: float, sequence_parallel: bool = True) -> Profile:
    """The profile of one TP shard: what each of ``tp`` devices computes and holds.

    Args:
        profile: The unsharded profile (one device per stage).
        tp: Tensor-parallel degree (1 returns ``profile`` itself).
        bandwidth_bytes_per_s: Intra-node link bandwidth per device.
        latency_ms: Intra-node per-step latency.
        sequence_parallel: Megatron's sequence parallelism (activations all split).

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
    for block, (comm_fwd, comm_bwd) in zip(profile.blocks, comm, strict=True):
        scale = 1 / (tp * TP_EFFICIENCY)
        split = block.kind != "norm"
        share = act_share if block.kind in ("decoder_layer", "block") else 1 / tp
        if block.kind == "norm" and not sequence_parallel:
            share = 1.0
        bwd_input = block.bwd_input_ms * scale + comm_bwd
        bwd_weight = block.bwd_weight_ms * scale
        blocks.append(dataclasses.replace(
            block, fwd_ms=block.fwd_ms * scale + comm_fwd, bwd_input_ms=bwd_input,
            bwd_weight_ms=bwd_weight, bwd_ms=bwd_input + bwd_weight,
            num_params=-(-block.num_params // tp) if split else block.num_params,
            param_bytes=-(-block.param_bytes // tp) if split else block.param_bytes,
            activation_bytes=round(block.activation_bytes * share),
            output_bytes=-(-block.output_bytes // tp),
            transient_bytes=-(-block.transient_bytes // tp), measured=()))
    note = (f"tensor parallel {tp}: block times / {tp} / {TP_EFFICIENCY} (shard efficiency, "
            f"assumed) plus ring all-reduces of the hidden state; parameters / {tp} (norms "
            f"whole); activations {'/ ' + str(tp) if sequence_parallel else 'per Korthikanti'}")
    model = dataclasses.replace(profile.model, notes=(*profile.model.notes, note))
    return dataclasses.replace(profile, model=model, blocks=tuple(blocks))

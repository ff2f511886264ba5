"""Tensor- and data-parallel costs: a profile sharded for TP, and ring collective times.

Pure functions beside ``autopart.cost.stage``: the mesh search (``autopart.solve.mesh``)
shards a profile with ``shard_profile`` and hands it to the pipeline search unchanged.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence parallelism,
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") on ``tp`` devices of one node, as autopart's runtime runs it
(``autopart.runtime.tensor_parallel``):

- parameters, gradients and optimizer state of embeddings, decoder layers and the
  head are split ``tp`` ways (the embedding and head by vocabulary); norms are replicated;
- compute per shard: the block's time / tp, divided by ``TP_EFFICIENCY`` (GEMMs ``tp``
  times narrower run below the full-size efficiency: an assumption, not a measurement;
  ``autopart verify`` calibrates it away). Without sequence parallelism the norms and
  residual adds run whole on every shard: there a profile of the shard itself is used
  where there is one (the analytical backend on the config with heads, intermediate
  size and vocabulary / tp, ``autopart.profile.tp_shard``). Under sequence parallelism
  every op of a layer is split, and an analytical (roofline) shard is exactly 1 / tp of
  the block, so the scaled figure is used; the shard profile still gives the exact
  parameter count (key-value heads replicated when fewer than tp);
- activations: the input of the attention's and the MLP's first split layers is
  all-gathered and saved whole by torch (one hidden state per layer half), and so is
  the head's input; everything else a layer keeps is split under sequence parallelism.
  Without it Korthikanti et al.'s per-layer count ``sbh (10 + 24 / tp)`` of ``sbh * 34``
  is used (the norm and dropout inputs stay whole). The last stage holds its
  vocabulary shard of the logits (the loss folds the shards' log-sum-exps);
- what crosses a pipeline cut: one sequence shard per tp rank under sequence
  parallelism, the whole replicated hidden state without it;
- collectives per block over the intra-node link, all of the hidden-state size
  ``b * s * h``, counted in all-reduces (``tp_collectives``): a decoder layer does two
  in the forward (after attention and after the MLP) and two in the backward (the
  gradient of each half's input, summed once for all its split layers), each of its
  halves one each way. Sequence parallelism turns each into a reduce-scatter plus an
  all-gather: the same ring time. The vocabulary-parallel embedding sums its lookups
  in the forward (an all-reduce; under sequence parallelism a reduce-scatter there and
  an all-gather in the backward); the head sums its input gradient in the backward
  (under sequence parallelism an all-gather of its input in the forward and a
  reduce-scatter in the backward). The loss's gather of two floats per position and
  rank, and the once-per-step sum of the norms' gradients, are not counted. They are
  not overlapped with compute (Megatron's default).

Data parallelism sharded by FSDP (``autopart.runtime.fsdp``): the memory is in
``autopart.cost.stage.static_bytes_per_param``; gathering parameters per microbatch puts an
all-gather before every F and B (``gather_per_microbatch``); the once-per-step gather
and the gradient reduce-scatter are placed against the pipeline by
``autopart.solve.mesh``.
"""

from __future__ import annotations

import dataclasses

from autopart.schema import BlockProfile, Profile

__all__ = ["gather_per_microbatch", "ring_all_gather_ms", "ring_all_reduce_ms", "shard_profile",
           "tp_comm_ms_per_block"]

TP_EFFICIENCY = 0.9
"""Compute efficiency of a TP shard relative to the whole block (stated assumption)."""

TP_COLLECTIVES = {"decoder_layer": (2, 2), "block": (2, 2), "attention": (1, 1),
                  "mlp": (1, 1), "embedding": (1, 0), "head": (0, 1), "norm": (0, 0)}
"""All-reduces of the hidden state per block kind without sequence parallelism:
(forward, backward)."""
_SEQUENCE_PARALLEL_COLLECTIVES = {"embedding": (0.5, 0.5), "head": (0.5, 0.5)}
"""Where sequence parallelism moves them: a reduce-scatter (half an all-reduce) one way
and an all-gather the other."""

_LAYER_HALVES = {"decoder_layer": 2, "block": 2, "attention": 1, "mlp": 1}
"""Inputs of split layers a block saves whole (one per layer half)."""
_REPLICATED_ACTIVATION = 10 / 34
"""Share of a layer's saved activations that TP without sequence parallelism keeps whole."""


def tp_collectives(kind: str, sequence_parallel: bool) -> tuple[float, float]:
    """All-reduces of the hidden state a block of ``kind`` runs, (forward, backward)."""
    if sequence_parallel and kind in _SEQUENCE_PARALLEL_COLLECTIVES:
        return _SEQUENCE_PARALLEL_COLLECTIVES[kind]
    return TP_COLLECTIVES[kind]


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
                         latency_ms: float, sequence_parallel: bool = True
                         ) -> list[tuple[float, float]]:
    """TP collective time of each block for one microbatch: (forward, backward) ms.

    The hidden state is the block's input (the previous block's output), or its own
    output for the first block.

    Args:
        profile: The unsharded profile.
        tp: Tensor-parallel degree.
        bandwidth_bytes_per_s: Intra-node link bandwidth per device.
        latency_ms: Intra-node per-step latency.
        sequence_parallel: The stream is sharded along the sequence.

    Returns:
        One (forward, backward) pair per block.
    """
    out = []
    for i, block in enumerate(profile.blocks):
        one = ring_all_reduce_ms(_hidden_in(profile, i), tp, bandwidth_bytes_per_s, latency_ms)
        num_fwd, num_bwd = tp_collectives(block.kind, sequence_parallel)
        out.append((num_fwd * one, num_bwd * one))
    return out


def _hidden_in(profile: Profile, idx: int) -> int:
    """The hidden state a block takes: the previous block's output (the first: its own)."""
    return profile.blocks[idx - 1].output_bytes if idx > 0 else profile.blocks[idx].output_bytes


def shard_profile(profile: Profile, tp: int, *, bandwidth_bytes_per_s: float,
                  latency_ms: float, sequence_parallel: bool = True,
                  shard: Profile | None = None) -> Profile:
    """The profile of one TP shard: what each of ``tp`` devices computes and holds.

    Args:
        profile: The unsharded profile (one device per stage).
        tp: Tensor-parallel degree (1 returns ``profile`` itself).
        bandwidth_bytes_per_s: Intra-node link bandwidth per device.
        latency_ms: Intra-node per-step latency.
        sequence_parallel: The stream sharded along the sequence (module docstring).
        shard: A profile of one shard itself (``autopart.profile.tp_shard``: the
            analytical backend on the config with heads, intermediate size and vocabulary
            / tp), same blocks in the same order. Its parameters and transient bytes
            replace the scaled ones, and without sequence parallelism its compute times
            and activations too; else times scale by ``1 / (tp * TP_EFFICIENCY)``.

    Returns:
        The same blocks (same names, same fingerprint) with times including the TP
        collectives, and parameters, activations, boundary and transient bytes of one
        shard; the model's vocabulary is the shard's (the last stage holds those
        logits), and a model note says how it was derived.
    """
    if tp == 1:
        return profile
    comm = tp_comm_ms_per_block(profile, tp, bandwidth_bytes_per_s, latency_ms,
                                sequence_parallel)
    blocks = []
    shards = profile.blocks if shard is None else shard.blocks
    for i, (block, part, (comm_fwd, comm_bwd)) in enumerate(
            zip(profile.blocks, shards, comm, strict=True)):
        out = _scaled(block, tp, _activation_share(profile, i, tp, sequence_parallel),
                      comm_fwd, comm_bwd, sequence_parallel)
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
    acts = (f"/ {tp} but the split layers' gathered inputs; one sequence shard crosses a cut"
            if sequence_parallel else "as without sequence parallelism; the whole hidden "
            "state crosses a cut")
    note = (f"tensor parallel {tp}: {how}, plus ring all-reduces of the hidden state; "
            f"activations {acts}; the last stage holds its vocabulary shard of the logits")
    model = dataclasses.replace(profile.model, notes=(*profile.model.notes, note),
                                vocab_size=-(-profile.model.vocab_size // tp))
    return dataclasses.replace(profile, model=model, blocks=tuple(blocks))


def _activation_share(profile: Profile, idx: int, tp: int, sequence_parallel: bool) -> float:
    """The share of block ``idx``'s saved activations one TP shard keeps (module docstring)."""
    block = profile.blocks[idx]
    whole = _LAYER_HALVES.get(block.kind, 1 if block.kind == "head" else 0) \
        * _hidden_in(profile, idx)
    if block.kind in _LAYER_HALVES and not sequence_parallel:
        return _REPLICATED_ACTIVATION + (1 - _REPLICATED_ACTIVATION) / tp
    if block.kind == "norm" and not sequence_parallel:
        return 1.0
    if block.activation_bytes <= 0:
        return 1 / tp
    kept = min(whole, block.activation_bytes)
    return (kept + (block.activation_bytes - kept) / tp) / block.activation_bytes


def gather_per_microbatch(profile: Profile, dp: int, param_bytes: int,
                          bandwidth_bytes_per_s: float, latency_ms: float) -> Profile:
    """FSDP gathering each block's parameters per microbatch: the profile with the exposed
    all-gathers in its block times.

    Every F and every B of a block all-gathers its parameters (``param_bytes`` each) over
    the ``dp`` replicas first. The next block's gather is prefetched while a block
    computes (torch's ``UNSHARD`` ahead of the compute; FSDP's backward prefetch), so
    only what the previous block's compute does not hide is exposed: in the forward the
    block before, in the backward the block after.

    Args:
        profile: The (TP-sharded) profile.
        dp: Data-parallel replicas.
        param_bytes: Bytes of a gathered parameter (the parameter dtype).
        bandwidth_bytes_per_s: The dp link's bandwidth per device.
        latency_ms: The dp link's per-step latency.

    Returns:
        The profile with each block's ``fwd_ms`` and ``bwd_input_ms`` (and ``bwd_ms``)
        grown by its exposed all-gather; ``profile`` itself for ``dp`` 1.
    """
    if dp == 1:
        return profile
    blocks = profile.blocks
    out = []
    for i, block in enumerate(blocks):
        gather = ring_all_gather_ms(block.num_params * param_bytes, dp, bandwidth_bytes_per_s,
                                    latency_ms)
        before = blocks[i - 1].fwd_ms if i > 0 else 0.0
        after = blocks[i + 1].bwd_input_ms if i + 1 < len(blocks) else 0.0
        fwd, bwd = max(0.0, gather - before), max(0.0, gather - after)
        out.append(dataclasses.replace(block, fwd_ms=block.fwd_ms + fwd,
                                       bwd_input_ms=block.bwd_input_ms + bwd,
                                       bwd_ms=block.bwd_ms + bwd))
    note = (f"FSDP over {dp}: every block's parameters all-gathered before its F and its B, "
            f"hidden under the neighbouring block's compute where that is longer")
    model = dataclasses.replace(profile.model, notes=(*profile.model.notes, note))
    return dataclasses.replace(profile, model=model, blocks=tuple(out))


def _scaled(block: BlockProfile, tp: int, share: float, comm_fwd: float,
            comm_bwd: float, sequence_parallel: bool) -> BlockProfile:
    """One block's shard by scaling: compute / (tp * efficiency); parameters, the
    workspace and its weight gradients / tp; saved activations and the gradients held
    from B to W by ``share``; what it sends / tp under sequence parallelism (a sequence
    shard), else whole. Every byte field scales, so a shard keeps the schema's relations
    (adopted gradients within the workspace)."""
    scale = 1 / (tp * TP_EFFICIENCY)
    split = block.kind != "norm"
    bwd_input = block.bwd_input_ms * scale + comm_bwd
    bwd_weight = block.bwd_weight_ms * scale
    return dataclasses.replace(
        block, fwd_ms=block.fwd_ms * scale + comm_fwd, bwd_input_ms=bwd_input,
        bwd_weight_ms=bwd_weight, bwd_ms=bwd_input + bwd_weight,
        split_extra_ms=block.split_extra_ms * scale,
        num_params=-(-block.num_params // tp) if split else block.num_params,
        param_bytes=-(-block.param_bytes // tp) if split else block.param_bytes,
        activation_bytes=round(block.activation_bytes * share),
        held_for_weight_bytes=round(block.held_for_weight_bytes * share),
        output_bytes=-(-block.output_bytes // tp) if sequence_parallel else block.output_bytes,
        transient_bytes=-(-block.transient_bytes // tp),
        adopted_grad_bytes=min(-(-block.adopted_grad_bytes // tp) if split
                               else block.adopted_grad_bytes, -(-block.transient_bytes // tp)),
        measured=())

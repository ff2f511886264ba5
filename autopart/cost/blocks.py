"""Per-block figures of a profile under a training setup, as arrays with prefix sums.

``block_arrays`` turns a profile's blocks into numpy arrays (times, bytes, parameters,
which blocks recomputation checkpoints, the modules held whole on several stages) with
prefix sums, so ``autopart.cost.stage.stage_cost`` prices any candidate stage in O(1).
``static_bytes_per_param`` (parameters, gradients, optimizer state per parameter) and
``checkpointed`` are the per-block rules the runtime shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopart.cost.held import HeldWhole, held_whole
from autopart.schema import DTYPE_BYTES, Profile, RuntimeOverhead, TrainingSetup

__all__ = ["BlockArrays", "block_arrays", "checkpointed", "static_bytes_per_param"]


_NOT_CHECKPOINTED = ("embedding", "norm", "head")


def checkpointed(kind: str) -> bool:
    """Whether a block of ``kind`` is checkpointed when its stage recomputes.

    The one rule shared by the cost model and the runtime (``autopart.runtime``):
    layers are; the embedding (it saves only token ids), the final norm and the head
    are not (the loss runs outside the stage, so checkpointing the head saves nothing).
    """
    return kind not in _NOT_CHECKPOINTED


def static_bytes_per_param(setup: TrainingSetup) -> float:
    """Bytes of parameters + gradients + optimizer state (+ master copy) per parameter,
    at the step's peak.

    Under ZeRO-1 (``setup.zero_stage == 1``) the optimizer state and the master copy
    are split over the ``dp_size`` replicas, so the figure can be fractional. Under FSDP
    (``zero_stage == 3``, ``autopart.runtime.fsdp``) the stored parameters (the master
    copy under mixed precision), their gradients and the optimizer state are split over
    the replicas; during the step torch's pipeline schedules keep each stage's parameters
    gathered (in the parameter dtype) and its gradients whole (accumulated in the
    gradient dtype) until the stage's last backward reduce-scatters them, so both count
    whole, gathered per step or per microbatch alike (a stage's parameters stay gathered
    from its first backward on).
    """
    num_states = {"adam": 2, "sgd": 1, "none": 0}[setup.optimizer]
    states = num_states * DTYPE_BYTES[setup.optimizer_dtype]
    master = setup.master_weights and setup.param_dtype != "float32"
    param, grad = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.grad_dtype]
    if setup.zero_stage == 3 and setup.dp_size > 1:
        stored = 4 if master else param
        return (stored + grad + states) / setup.dp_size + param + grad
    sharded = states + (4 if master else 0)
    if setup.zero_stage == 1 and setup.dp_size > 1:
        return param + grad + sharded / setup.dp_size
    return param + grad + sharded


@dataclass(frozen=True, slots=True)
class BlockArrays:
    """Per-block figures as numpy arrays plus prefix sums, for O(1) stage costs.

    Prefix arrays have length ``num_blocks + 1``; the blocks ``i .. j`` (inclusive)
    sum to ``prefix[j + 1] - prefix[i]``.
    """

    fwd_ms: np.ndarray
    bwd_input_ms: np.ndarray
    bwd_weight_ms: np.ndarray
    static_bytes: np.ndarray
    activation_bytes: np.ndarray
    output_bytes: np.ndarray
    transient_bytes: np.ndarray
    num_params: np.ndarray
    prefix_fwd: np.ndarray
    prefix_bwd_input: np.ndarray
    prefix_bwd_weight: np.ndarray
    prefix_static: np.ndarray
    prefix_activation: np.ndarray
    checkpointed: np.ndarray
    """Per block, whether recomputation checkpoints it (``checkpointed``)."""
    held_output_bytes: np.ndarray
    """Per block, what a stage ending there holds per microbatch until its backward:
    its output (the logits for a causal LM's head, whose loss runs outside the stage)."""
    prefix_kept: np.ndarray
    """Prefix of what each block keeps under recomputation: its input (the previous
    block's output) if checkpointed, else its activations."""
    prefix_recompute_fwd: np.ndarray
    """Prefix of the forward time recomputation repeats (checkpointed blocks)."""
    prefix_num_params: np.ndarray
    held: HeldWhole | None = None
    """The modules held whole by every stage holding part of them (``autopart.cost.held``)."""
    held_static_bytes: np.ndarray | None = None
    """Per held group, the static bytes of its whole module."""
    prefix_own_static: np.ndarray | None = None
    """Prefix of the blocks' static bytes less their held groups' share."""
    prefix_own_params: np.ndarray | None = None
    """Prefix of the blocks' parameters less their held groups' share."""
    overhead: RuntimeOverhead | None = None
    """The runtime's own cost per action, added to every stage's F and B."""
    prefix_split_extra: np.ndarray | None = None
    """Prefix of the blocks' ``split_extra_ms`` (None: all zero)."""
    vocab_parts: np.ndarray | None = None
    """Per block, whether it is a vocabulary part of the head (None: the head is whole)."""
    head_grad_fwd_ms: float = 0.0
    """F time a stage with shards adds per microbatch: the dense gradient of the head
    weight its shards add their rows into is zero-filled once per step, in the first
    forward (``ProfileSetup.head_grad_ms``), spread here over the step's microbatches."""
    head_slice_fwd_ms: float = 0.0
    """F time a stage with shards adds per microbatch: the sliced loss's fixed cost per
    call, paid once since a stage runs its shards as one slice
    (``ProfileSetup.head_slice_fwd_ms``)."""
    head_slice_bwd_ms: float = 0.0
    """The same for its B."""
    glue_lead_ms: float = 0.0
    """The model's code before the first block, which every stage runs per F (all of
    ``ProfileSetup.glue_fwd_ms`` for profiles without per-block glue)."""
    prefix_glue_after: np.ndarray | None = None
    """Prefix of the blocks' ``glue_after_ms`` (None: all zero)."""
    prefix_stand_in: np.ndarray | None = None
    """Prefix of the blocks' ``stand_in_ms`` (None: all zero)."""
    walk_ms: np.ndarray | None = None
    """Per block, ``BlockProfile.walk_ms`` (None: all zero)."""
    prefix_held_for_weight: np.ndarray | None = None
    """Prefix of the blocks' ``held_for_weight_bytes`` (None: all zero)."""
    adopted_grad_bytes: np.ndarray | None = None
    """Per block, the weight gradients in its workspace (None: all zero)."""

    @property
    def num_blocks(self) -> int:
        """Number of blocks in the chain."""
        return len(self.fwd_ms)

    def stage_time_ms(self, first: int, last: int, recompute: bool = False) -> float:
        """F + B + W of blocks ``first .. last`` for one microbatch."""
        total = (self.prefix_fwd[last + 1] - self.prefix_fwd[first]
                 + self.prefix_bwd_input[last + 1] - self.prefix_bwd_input[first]
                 + self.prefix_bwd_weight[last + 1] - self.prefix_bwd_weight[first])
        if recompute:
            total += self.prefix_recompute_fwd[last + 1] - self.prefix_recompute_fwd[first]
        return float(total)


def block_arrays(profile: Profile, setup: TrainingSetup) -> BlockArrays:
    """Build the per-block arrays of ``profile`` under ``setup``."""
    blocks = profile.blocks
    per_param = static_bytes_per_param(setup)
    fwd = np.array([b.fwd_ms for b in blocks], dtype=np.float64)
    bwd_in = np.array([b.bwd_input_ms for b in blocks], dtype=np.float64)
    bwd_w = np.array([b.bwd_weight_ms for b in blocks], dtype=np.float64)
    num_params = np.array([b.num_params for b in blocks], dtype=np.int64)
    static = np.round(num_params * per_param).astype(np.int64)
    whole = held_whole(profile)
    act = np.array([b.activation_bytes for b in blocks], dtype=np.int64)
    out = np.array([b.output_bytes for b in blocks], dtype=np.int64)
    transient = np.array([b.transient_bytes for b in blocks], dtype=np.int64)
    ckpt = np.array([checkpointed(b.kind) for b in blocks], dtype=bool)
    held = out.copy()
    held[-1] = _held_final_output(profile)
    kept = np.where(ckpt, np.concatenate([[0], out[:-1]]), act)

    def prefix(a: np.ndarray) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(a)])

    return BlockArrays(
        fwd_ms=fwd, bwd_input_ms=bwd_in, bwd_weight_ms=bwd_w, static_bytes=static,
        activation_bytes=act, output_bytes=out, transient_bytes=transient,
        num_params=num_params, prefix_fwd=prefix(fwd), prefix_bwd_input=prefix(bwd_in),
        prefix_bwd_weight=prefix(bwd_w), prefix_static=prefix(static),
        prefix_activation=prefix(act), checkpointed=ckpt, held_output_bytes=held,
        prefix_kept=prefix(kept), prefix_recompute_fwd=prefix(np.where(ckpt, fwd, 0.0)),
        prefix_num_params=prefix(num_params), overhead=setup.runtime_overhead,
        **_glue_arrays(profile),
        **_held_arrays(whole, static, num_params, per_param),
        vocab_parts=_vocab_parts(profile),
        prefix_split_extra=(prefix(np.array([b.split_extra_ms for b in blocks],
                                            dtype=np.float64))
                            if any(b.split_extra_ms for b in blocks) else None),
        head_grad_fwd_ms=profile.setup.head_grad_ms / max(setup.num_microbatches, 1),
        head_slice_fwd_ms=profile.setup.head_slice_fwd_ms,
        head_slice_bwd_ms=profile.setup.head_slice_bwd_ms,
        prefix_held_for_weight=prefix(np.array([b.held_for_weight_bytes for b in blocks],
                                               dtype=np.int64)),
        adopted_grad_bytes=np.array([b.adopted_grad_bytes for b in blocks], dtype=np.int64),
    )


def _glue_arrays(profile: Profile) -> dict:
    """``BlockArrays``' fields of what a stage's F runs besides its blocks."""
    after = np.array([b.glue_after_ms for b in profile.blocks], dtype=np.float64)
    stand_in = np.array([b.stand_in_ms for b in profile.blocks], dtype=np.float64)
    walk = np.array([b.walk_ms for b in profile.blocks], dtype=np.float64)
    return {"glue_lead_ms": max(profile.setup.glue_fwd_ms - float(after.sum()), 0.0),
            "prefix_glue_after": np.concatenate([[0.0], np.cumsum(after)]),
            "prefix_stand_in": np.concatenate([[0.0], np.cumsum(stand_in)]),
            "walk_ms": walk}


def _held_arrays(held: HeldWhole | None, static: np.ndarray, num_params: np.ndarray,
                 per_param: float) -> dict:
    """``BlockArrays``' held-whole fields: each group's whole static bytes (a cut-up
    module's parts' static bytes summed, so a stage extended to the module's ends holds
    exactly that; at least the whole weight's), and the blocks' static bytes and
    parameters outside their group."""
    if held is None:
        return {}
    in_group = held.group_of >= 0
    cut = np.zeros(len(static), dtype=bool) if held.span is None else held.span[1] > held.span[0]
    part_static = np.where(cut, static, np.round(held.part_params * per_param)).astype(np.int64)
    part_static = np.where(in_group, part_static, 0)
    whole = np.array([max(int(static[(held.group_of == g) & cut].sum()), round(int(w) * per_param))
                      for g, w in enumerate(held.whole_params)], dtype=np.int64)
    own_params = num_params - np.where(in_group, held.part_params, 0)
    return {"held": held, "held_static_bytes": whole,
            "prefix_own_static": np.concatenate([[0], np.cumsum(static - part_static)]),
            "prefix_own_params": np.concatenate([[0], np.cumsum(own_params)])}


def _vocab_parts(profile: Profile) -> np.ndarray | None:
    parts = np.array([bool(b.parts) and b.parts[-1].axis == "vocab" for b in profile.blocks],
                     dtype=bool)
    return parts if parts.any() else None


def _held_final_output(profile: Profile) -> int:
    """The last stage's output per microbatch: a causal LM's logits, else the block output.

    The profile's head block ends in the loss (4 bytes), but the pipeline's last stage
    returns the logits and torch's schedule computes the loss from them; a head split
    into vocabulary shards returns the per-position losses instead (float32, one per
    position but the last: ``autopart.runtime.head_shards.token_losses``).
    """
    last = profile.blocks[-1]
    vocab = profile.model.vocab_size
    setup = profile.setup
    if last.parts and last.parts[-1].axis == "vocab":
        return setup.micro_batch_size * max(setup.seq_len - 1, 1) * 4
    if last.kind != "head" or vocab <= 0:
        return last.output_bytes
    return setup.micro_batch_size * setup.seq_len * vocab * DTYPE_BYTES.get(setup.dtype, 4)

"""Pure cost functions: block costs + training setup -> stage times, memory and comm.

Nothing here knows about schedules or solvers. The simulator turns StageCosts into
a step time and per-rank peaks; the solvers evaluate candidate stages through
``BlockArrays`` (prefix sums, O(1) per stage).

Memory model (DESIGN.md; what torch 2.13's ``PipelineStage`` allocates), per stage:

- ``static_bytes``: params + grads + optimizer state (+ master weights), from the
  ``TrainingSetup`` precision preset (``static_bytes_per_param``).
- ``activation_bytes``, held by one microbatch from its F until its backward: the
  blocks' saved activations (under recompute, only the checkpointed blocks' inputs,
  ``checkpointed``), plus the stage output that torch keeps in ``fwd_cache`` until
  the backward (for a causal LM's last stage, the logits: the loss runs outside the
  stage), less the first block's saved input, which lives in a receive buffer.
- receive buffers (``autopart.cost.rank.recv_buffer_bytes``): torch allocates one
  activation buffer and one gradient buffer per microbatch (``args_recv_info[mb]``,
  ``grad_recv_info[mb]``) at the first step and keeps them:
  ``m * (input_bytes + output_bytes)``.
- ``transient_bytes``: the largest block workspace on top of that block's saved
  activations (the profile measures it at the block's own peak, so a workspace that
  peaks after autograd freed saved tensors adds only the excess); under recompute
  the largest rebuilt block's activations come on top. The simulator adds it to the
  activations held while the stage computes, not to the rank's overall peak.
- ``held_for_weight_bytes``, split-backward (zero-bubble) schedules only: what one
  microbatch holds from its B until its W on top of ``activation_bytes``. torch's
  ``stage_backward_input`` keeps the whole graph and the gradient into every op that
  feeds a weight (the blocks' ``held_for_weight_bytes``); the first stage skips B
  (its W runs the full backward), so it adds nothing; the last stage drops its held
  output (the logits) at B, as the loss is all its backward state keeps.
- ``adopted_grad_bytes``: the part of ``transient_bytes`` that is weight gradients.
  A stage's first backward in a step (gradients ``None`` after ``zero_grad()``)
  hands them to the parameters' ``.grad``, counted in ``static_bytes``, and a
  forward computes none, so the simulator leaves them out of those actions' workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopart.cost.blocks import BlockArrays
from autopart.schema import RuntimeOverhead, TrainingSetup

__all__ = ["StageCost", "comm_ms", "stage_cost", "stage_post_ms"]


@dataclass(frozen=True, slots=True)
class StageCost:
    """Times and memory of one stage for one microbatch."""

    fwd_ms: float
    bwd_input_ms: float
    """B; includes the recomputed forward when ``recompute`` is set."""
    bwd_weight_ms: float
    """W."""
    static_bytes: int
    activation_bytes: int
    """Held from this stage's F of a microbatch until its backward of that microbatch:
    saved activations + the held output, less the input kept in a receive buffer."""
    input_bytes: int
    """Received from the previous stage per microbatch (0 for the first stage)."""
    output_bytes: int
    """Sent to the next stage per microbatch (0 for the last stage)."""
    transient_bytes: int
    param_count: int
    recompute: bool = False
    held: tuple[tuple[str, int], ...] = ()
    """``(module, static bytes)`` of every module this stage holds whole while holding only
    part of it (``autopart.cost.held``: a tied weight, the head cut by vocabulary, a half cut
    by units), so another stage holds it too; included in ``static_bytes``, counted once
    per rank, its gradient summed over the ranks holding it."""
    held_for_weight_bytes: int = 0
    """Split-backward schedules: bytes a microbatch holds from its B until its W on top
    of ``activation_bytes`` (module docstring; negative when B frees more than it keeps)."""
    adopted_grad_bytes: int = 0
    """The part of ``transient_bytes`` that is weight gradients: paid only by the stage's
    weight-gradient backwards after its first in a step (module docstring)."""
    split_extra_ms: float = 0.0
    """What torch's split backward costs beyond the full one (``BlockProfile.
    split_extra_ms``): zero-bubble schedules run ``bwd_weight_ms`` + this as W."""

    @property
    def bwd_ms(self) -> float:
        """Full backward B + W."""
        return self.bwd_input_ms + self.bwd_weight_ms


def comm_ms(num_bytes: int, setup: TrainingSetup) -> float:
    """Time to send ``num_bytes`` point to point over the pipeline link."""
    if num_bytes <= 0:
        return 0.0
    return setup.link_latency_ms + 1e3 * num_bytes / setup.link_bandwidth_bytes_per_s


def _outside_blocks_ms(arrays: BlockArrays, first: int, last: int) -> float:
    """Per F, what the stage runs besides its blocks (``autopart.runtime.stages``): the
    model's own code from its start to the stage's end (the glue before the first block
    and after each block up to the next stage's first call), the stand-ins of the blocks
    before it and, starting inside a split half's call, the parent's code on meta up to
    it. A stage starting inside the head (a vocabulary part after the first) runs
    none of it."""
    if arrays.vocab_parts is not None and first > 0 and arrays.vocab_parts[first - 1] \
            and arrays.vocab_parts[first]:
        return 0.0
    glue = arrays.glue_lead_ms
    if arrays.prefix_glue_after is not None:
        glue += float(arrays.prefix_glue_after[last + 1])
    if arrays.prefix_stand_in is not None:
        glue += float(arrays.prefix_stand_in[first])
    if arrays.walk_ms is not None:
        glue += float(arrays.walk_ms[first])
    return glue


def stage_cost(arrays: BlockArrays, first: int, last: int, recompute: bool = False) -> StageCost:
    """Cost of the stage holding blocks ``first .. last`` (inclusive).

    With a runtime overhead in ``arrays`` (the machine check), F and B each carry the
    runtime's per-action cost and one p2p op per cut next to the stage; F also carries
    what the stage runs outside its blocks (``_outside_blocks_ms``) and, on a stage with
    vocabulary shards of the head, the once-per-step zero-fill of the head's gradient
    spread over the microbatches (``BlockArrays.head_grad_fwd_ms``), and the sliced
    loss's fixed cost per call on its F and B (``BlockArrays.head_slice_fwd_ms``).
    ``activation_bytes`` follows the module docstring: saved activations (with
    ``recompute``, only the inputs of checkpointed blocks) + the held output - the
    first block's input, which torch's receive buffer holds (a head shard's never include
    it). With ``recompute`` the
    backward re-runs the checkpointed blocks' forward and the largest one's
    activations are rebuilt transiently during its backward.
    """
    if not 0 <= first <= last < arrays.num_blocks:
        raise ValueError(f"bad stage bounds {first}..{last} for {arrays.num_blocks} blocks")
    sl = slice(first, last + 1)
    fwd = float(arrays.prefix_fwd[last + 1] - arrays.prefix_fwd[first])
    bwd_in = float(arrays.prefix_bwd_input[last + 1] - arrays.prefix_bwd_input[first])
    work = arrays.transient_bytes
    work_first = work if arrays.adopted_grad_bytes is None else work - arrays.adopted_grad_bytes
    transient = _stage_workspace(arrays, work, first, last)
    adopted = transient - _stage_workspace(arrays, work_first, first, last)
    input_bytes = int(arrays.output_bytes[first - 1]) if first > 0 else 0
    if recompute:
        bwd_in += float(arrays.prefix_recompute_fwd[last + 1]
                        - arrays.prefix_recompute_fwd[first])
        act = int(arrays.prefix_kept[last + 1] - arrays.prefix_kept[first])
        rebuilt = arrays.activation_bytes[sl][arrays.checkpointed[sl]]
        transient = int(work[sl].max())
        adopted = transient - int(work_first[sl].max())
        transient += int(rebuilt.max()) if len(rebuilt) else 0
        first_keeps = input_bytes if arrays.checkpointed[first] else arrays.activation_bytes[first]
    else:
        act = int(arrays.prefix_activation[last + 1] - arrays.prefix_activation[first])
        # a head shard's activations are its sliced loss's own (``levels.split_head``),
        # which never include the input the receive buffer holds
        shard = arrays.vocab_parts is not None and bool(arrays.vocab_parts[first])
        first_keeps = 0 if shard else arrays.activation_bytes[first]
    act += int(arrays.held_output_bytes[last]) - min(input_bytes, int(first_keeps))
    last_block = arrays.num_blocks - 1
    static, params, held = _stage_static(arrays, first, last)
    fwd_extra, bwd_extra = _action_overhead_ms(arrays.overhead, first > 0, last < last_block)
    bwd_weight = float(arrays.prefix_bwd_weight[last + 1] - arrays.prefix_bwd_weight[first])
    slice_fwd, slice_bwd = _head_slice_ms(arrays, first, last)
    if first == 0:
        # the model's first stage has no input gradient to hurry: torch's split backward
        # skips its B and runs the whole backward as its W (``backward_one_chunk``)
        bwd_in, bwd_weight = 0.0, bwd_weight + bwd_in
    return StageCost(
        fwd_ms=fwd + fwd_extra + _outside_blocks_ms(arrays, first, last)
        + _head_grad_fwd_ms(arrays, first, last) + slice_fwd,
        bwd_input_ms=bwd_in + bwd_extra + slice_bwd,
        bwd_weight_ms=bwd_weight,
        static_bytes=static,
        activation_bytes=act,
        input_bytes=input_bytes,
        output_bytes=int(arrays.output_bytes[last]) if last < last_block else 0,
        transient_bytes=transient,
        param_count=params,
        recompute=recompute,
        held=held,
        held_for_weight_bytes=_held_for_weight(arrays, first, last),
        adopted_grad_bytes=adopted,
        # the first stage runs its whole backward as W: no split, nothing extra
        split_extra_ms=float(arrays.prefix_split_extra[last + 1]
                             - arrays.prefix_split_extra[first])
        if arrays.prefix_split_extra is not None and first > 0 else 0.0,
    )


def _stage_static(arrays: BlockArrays, first: int, last: int
                  ) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """Static bytes and parameters of a stage, and the modules it holds whole
    (``autopart.cost.held``): its blocks' own share, plus each held group's whole."""
    held = arrays.held
    if held is None:
        return (int(arrays.prefix_static[last + 1] - arrays.prefix_static[first]),
                int(arrays.prefix_num_params[last + 1] - arrays.prefix_num_params[first]), ())
    groups = held.groups_in(first, last)
    static = int(arrays.prefix_own_static[last + 1] - arrays.prefix_own_static[first])
    params = int(arrays.prefix_own_params[last + 1] - arrays.prefix_own_params[first])
    whole = arrays.held_static_bytes
    static += sum(int(whole[g]) for g, _ in groups)
    params += sum(int(held.whole_params[g]) for g, _ in groups)
    return static, params, tuple((held.keys[g], int(whole[g])) for g, shared in groups
                                 if shared)



def _held_for_weight(arrays: BlockArrays, first: int, last: int) -> int:
    """B..W bytes on top of the activations (module docstring): none on the first stage,
    which skips B; the blocks' kept gradients, less the held output on the last stage."""
    prefix = arrays.prefix_held_for_weight
    if first == 0 or prefix is None:
        return 0
    kept = int(prefix[last + 1] - prefix[first])
    if last == arrays.num_blocks - 1:
        kept -= int(arrays.held_output_bytes[last])
    return kept


def _head_grad_fwd_ms(arrays: BlockArrays, first: int, last: int) -> float:
    """The head gradient's zero-fill per microbatch, if the stage holds vocabulary shards.

    The runtime creates one dense gradient per rank and step (``autopart.runtime.
    head_shards``); a rank with shards in two stages is charged it twice."""
    return arrays.head_grad_fwd_ms if _holds_shards(arrays, first, last) else 0.0


def _head_slice_ms(arrays: BlockArrays, first: int, last: int) -> tuple[float, float]:
    """The sliced loss's fixed F and B ms per microbatch, if the stage holds shards (it
    runs them as one slice, ``autopart.runtime.stages``)."""
    if not _holds_shards(arrays, first, last):
        return 0.0, 0.0
    return arrays.head_slice_fwd_ms, arrays.head_slice_bwd_ms


def _holds_shards(arrays: BlockArrays, first: int, last: int) -> bool:
    """Whether blocks ``first .. last`` include a vocabulary part of the head."""
    shards = arrays.vocab_parts
    return shards is not None and bool(shards[first:last + 1].any())


def stage_post_ms(overhead: RuntimeOverhead | None, receives: bool, sends: bool) -> float:
    """What a stage's F, and again its B, are charged for posting its sends and receives:
    one p2p op per boundary at the 1F1B price (F receives activations and sends them on;
    B the gradients, the other way). Part of ``StageCost.fwd_ms`` and ``bwd_input_ms``;
    torch posts them outside ``forward_one_chunk`` and ``backward_one_chunk``, so a
    measured F or B span holds none of it (``autopart.verify``'s per-stage errors take
    it off).

    Args:
        overhead: The machine check (``None``: nothing charged).
        receives: The stage has a stage before it.
        sends: The stage has a stage after it.
    """
    return 0.0 if overhead is None else overhead.p2p_ms * (int(receives) + int(sends))


def _action_overhead_ms(overhead: RuntimeOverhead | None, receives: bool,
                        sends: bool) -> tuple[float, float]:
    """The runtime's own ms per F and per B of a stage: the action, plus its posts
    (``stage_post_ms``)."""
    if overhead is None:
        return 0.0, 0.0
    p2p = stage_post_ms(overhead, receives, sends)
    return overhead.fwd_action_ms + p2p, overhead.bwd_action_ms + p2p


def _stage_workspace(arrays: BlockArrays, work: np.ndarray, first: int, last: int) -> int:
    """Bytes above the stage's held activations at its peak: ``max_j (work_j -
    activations of the stage's blocks after j)``, at least 0 (``work``: the blocks'
    ``transient_bytes``, or those less their adopted gradients).

    Block ``j`` runs (forward, or backward) while the blocks before it hold their
    activations and the blocks after it do not (not yet, or no longer), so its
    workspace coincides with only part of the stage's activations. The embedding's
    gradient (as large as its weight, accumulated per microbatch) thus hides under
    the layers' activations that are not alive while it runs. A stage's vocabulary
    shards of the head run as one slice of its rows (``autopart.runtime.stages``), so
    their workspaces add up, at the last shard.
    """
    work = work[first:last + 1]
    shards = None if arrays.vocab_parts is None else arrays.vocab_parts[first:last + 1]
    if shards is not None and shards.any():
        where = np.flatnonzero(shards)
        work = work.copy()
        work[where[-1]] = work[where].sum()
        work[where[:-1]] = 0
    held_after = (arrays.prefix_activation[last + 1]
                  - arrays.prefix_activation[first + 1:last + 2])
    return max(int((work - held_after).max()), 0)

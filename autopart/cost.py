"""Pure cost functions: block costs + training setup -> stage times, memory and comm.

Nothing here knows about schedules or solvers. The simulator turns StageCosts into
a step time; the solvers evaluate candidate stages through ``BlockArrays`` (prefix
sums, O(1) per stage).

Memory model (DESIGN.md): per rank,
    static      = params + grads + optimizer state (+ fp32 master weights)
    activations = in_flight(stage) * activation_bytes(stage), summed over its stages
    plus boundary send/recv buffers and the largest transient workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopart.schema import DTYPE_BYTES, Plan, Profile, RuntimeOverhead, TrainingSetup

__all__ = [
    "BlockArrays",
    "StageCost",
    "block_arrays",
    "comm_ms",
    "stage_cost",
    "static_bytes_per_param",
    "step_overhead_ms",
]


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
    """Held from this stage's F of a microbatch until its backward of that microbatch."""
    input_bytes: int
    """Received from the previous stage per microbatch (0 for the first stage)."""
    output_bytes: int
    """Sent to the next stage per microbatch (0 for the last stage)."""
    transient_bytes: int
    param_count: int
    recompute: bool = False

    @property
    def bwd_ms(self) -> float:
        """Full backward B + W."""
        return self.bwd_input_ms + self.bwd_weight_ms


def static_bytes_per_param(setup: TrainingSetup) -> float:
    """Bytes of parameters + gradients + optimizer state (+ master copy) per parameter.

    Under ZeRO-1 (``setup.zero_stage == 1``) the optimizer state and the master copy
    are split over the ``dp_size`` replicas, so the figure can be fractional.
    """
    num_states = {"adam": 2, "sgd": 1, "none": 0}[setup.optimizer]
    sharded = num_states * DTYPE_BYTES[setup.optimizer_dtype]
    if setup.master_weights and setup.param_dtype != "float32":
        sharded += 4
    if setup.zero_stage == 1 and setup.dp_size > 1:
        return DTYPE_BYTES[setup.param_dtype] + DTYPE_BYTES[setup.grad_dtype] + \
            sharded / setup.dp_size
    return DTYPE_BYTES[setup.param_dtype] + DTYPE_BYTES[setup.grad_dtype] + sharded


def step_overhead_ms(setup: TrainingSetup) -> float:
    """The runtime's fixed work per step (``RuntimeOverhead.step_ms``; 0 without a check)."""
    overhead = setup.runtime_overhead
    return overhead.step_ms if overhead is not None else 0.0


def comm_ms(num_bytes: int, setup: TrainingSetup) -> float:
    """Time to send ``num_bytes`` point to point over the pipeline link."""
    if num_bytes <= 0:
        return 0.0
    return setup.link_latency_ms + 1e3 * num_bytes / setup.link_bandwidth_bytes_per_s


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
    prefix_input_of_block: np.ndarray
    """Prefix of the bytes each block receives (the previous block's output): the
    activations a stage keeps under per-block recomputation."""
    prefix_num_params: np.ndarray
    overhead: RuntimeOverhead | None = None
    """The runtime's own cost per action, added to every stage's F and B."""

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
            total += self.prefix_fwd[last + 1] - self.prefix_fwd[first]
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
    act = np.array([b.activation_bytes for b in blocks], dtype=np.int64)
    out = np.array([b.output_bytes for b in blocks], dtype=np.int64)
    transient = np.array([b.transient_bytes for b in blocks], dtype=np.int64)
    input_of_block = np.concatenate([[0], out[:-1]])

    def prefix(a: np.ndarray) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(a)])

    return BlockArrays(
        fwd_ms=fwd, bwd_input_ms=bwd_in, bwd_weight_ms=bwd_w, static_bytes=static,
        activation_bytes=act, output_bytes=out, transient_bytes=transient,
        num_params=num_params, prefix_fwd=prefix(fwd), prefix_bwd_input=prefix(bwd_in),
        prefix_bwd_weight=prefix(bwd_w), prefix_static=prefix(static),
        prefix_activation=prefix(act), prefix_input_of_block=prefix(input_of_block),
        prefix_num_params=prefix(num_params), overhead=setup.runtime_overhead,
    )


def stage_cost(arrays: BlockArrays, first: int, last: int, recompute: bool = False) -> StageCost:
    """Cost of the stage holding blocks ``first .. last`` (inclusive).

    With a runtime overhead in ``arrays`` (the machine check), F and B each carry the
    runtime's per-action cost and one p2p op per cut next to the stage.
    With ``recompute`` every block of the stage is checkpointed: a microbatch keeps
    only each block's input, the backward re-runs the forward, and the largest
    block's activations are rebuilt transiently during its backward.
    """
    if not 0 <= first <= last < arrays.num_blocks:
        raise ValueError(f"bad stage bounds {first}..{last} for {arrays.num_blocks} blocks")
    sl = slice(first, last + 1)
    fwd = float(arrays.prefix_fwd[last + 1] - arrays.prefix_fwd[first])
    bwd_in = float(arrays.prefix_bwd_input[last + 1] - arrays.prefix_bwd_input[first])
    transient = int(arrays.transient_bytes[sl].max())
    if recompute:
        bwd_in += fwd
        act = int(arrays.prefix_input_of_block[last + 1] - arrays.prefix_input_of_block[first])
        transient += int(arrays.activation_bytes[sl].max())
    else:
        act = int(arrays.prefix_activation[last + 1] - arrays.prefix_activation[first])
    last_block = arrays.num_blocks - 1
    fwd_extra, bwd_extra = _action_overhead_ms(arrays.overhead, first > 0, last < last_block)
    return StageCost(
        fwd_ms=fwd + fwd_extra,
        bwd_input_ms=bwd_in + bwd_extra,
        bwd_weight_ms=float(arrays.prefix_bwd_weight[last + 1] - arrays.prefix_bwd_weight[first]),
        static_bytes=int(arrays.prefix_static[last + 1] - arrays.prefix_static[first]),
        activation_bytes=act,
        input_bytes=int(arrays.output_bytes[first - 1]) if first > 0 else 0,
        output_bytes=int(arrays.output_bytes[last]) if last < last_block else 0,
        transient_bytes=transient,
        param_count=int(arrays.prefix_num_params[last + 1] - arrays.prefix_num_params[first]),
        recompute=recompute,
    )


def _action_overhead_ms(overhead: RuntimeOverhead | None, receives: bool,
                        sends: bool) -> tuple[float, float]:
    """The runtime's own ms per F and per B of a stage: the action, plus one p2p op per
    boundary (F receives activations and sends them on; B the gradients, the other way)."""
    if overhead is None:
        return 0.0, 0.0
    p2p = overhead.p2p_ms * (int(receives) + int(sends))
    return overhead.fwd_action_ms + p2p, overhead.bwd_action_ms + p2p


def stage_costs_of_plan(plan: Plan) -> list[StageCost]:
    """Rebuild the StageCosts recorded in ``plan`` (to simulate a plan without its profile)."""
    return [StageCost(fwd_ms=s.fwd_ms, bwd_input_ms=s.bwd_input_ms,
                      bwd_weight_ms=s.bwd_weight_ms, static_bytes=s.static_bytes,
                      activation_bytes=s.activation_bytes, input_bytes=s.input_bytes,
                      output_bytes=s.output_bytes, transient_bytes=s.transient_bytes,
                      param_count=s.param_count, recompute=s.recompute)
            for s in plan.stages]

"""The solvers' view of a block chain: O(1) stage time and memory, vectorized windows.

A stage is the half-open block range ``[i, j)`` (blocks ``i .. j - 1``); positions
run ``0 .. n``. ``r`` is 1 when the stage recomputes its forward (activation
checkpointing), else 0; ``memory`` also takes ``r = 2``, a stage of a zero-bubble
schedule (no recompute, ``act_2`` below). Every solver (DP, ILP, brute force in the tests) uses the
definitions below, so their answers are comparable:

    time(i, j, r)      = F+B+W of blocks i..j-1  + r * F of checkpointed blocks + comm(j)
    comm(j)            = autopart.cost.stage.comm_ms(output_bytes[j - 1])  for 0 < j < n, else 0
    neck(i, j, r, b)   = time(i, j, r) - comm(j) + b * (comm(j) + [i > 0] * comm_max)

``time`` counts one direction per cut (the ILP's stage time). The DP's objective
(``autopart.solve.dp``) counts what the simulator does: both directions of every cut
(the activation forward, the gradient backward) on the fill/drain path, and in a
stage's steady-state round, ``neck``, the transfers only where the rank waits on them
(``b = 1``: 1F1B's batched send/recv; other schedules send asynchronously). A round
of 1F1B waits on the stage's output cut and on its input cut, bounded by
``comm_max``, the costliest cut, so that ``neck`` shrinks as the start moves right
(the DP's windows need it); every cut of an LLM's chain carries the same hidden
state, so the bound is that cut's own cost there.
    memory(i, j, r, k) = static(i..j-1) + k * act_r(i..j-1) + transient_r(i..j-1)
                         + m * max(out[b] for b in [max(i - 1, 0), j - 1])
                         + (m + k) * out[j - 1]

``k`` is the stage's in-flight microbatch count (``autopart.simulate.max_in_flight``),
``m`` the number of microbatches, ``out`` the bytes crossing a cut (the head's output
zeroed). ``act_0`` sums the blocks' ``activation_bytes``; ``act_1`` what recomputation
keeps (``BlockArrays.prefix_kept``); ``act_2`` (zero-bubble schedules, which never
recompute) adds to ``act_0`` every block's ``held_for_weight_bytes``, the gradients a
microbatch holds from its B to its W (more than the simulator's: the first stage holds
none, the last drops its logits at B); all add the logits the last stage holds.
``transient_0`` is the largest block workspace and ``transient_1`` adds the largest
checkpointed block's activations (rebuilt during backward), as in
``autopart.cost.stage.stage_cost``. The last two terms bound torch's receive buffers (``m``
activation buffers of the input, ``m`` gradient buffers of the output) and the output
each in-flight microbatch holds until its backward; the input side takes the largest
tensor entering, crossing or leaving the stage, which keeps feasibility closed under
shrinking a stage (the exact DP relies on it). So the closed form is the simulator's
stage memory or more: it also counts the first stage's absent input buffers and the
input that the first block saves, which the receive buffer holds.

For a fixed end ``j`` both time and memory are non-increasing in ``i`` (fewer blocks,
same boundary), so the feasible starts form a window ``[lo(j), j - 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autopart.cost.blocks import BlockArrays
from autopart.cost.stage import comm_ms
from autopart.schema import TrainingSetup

_REL_TOL = 1e-9
"""Stage times within this relative tolerance of a bound count as meeting it."""


def range_table(values: np.ndarray, op: np.ufunc, max_span: int | None = None) -> np.ndarray:
    """Sparse table: row ``k`` holds ``op`` over ``values[x : x + 2**k]`` (padded).

    Queries may span at most ``max_span`` values (default: all of them).
    """
    num = len(values)
    num_levels = max(1, int(num if max_span is None else max_span).bit_length())
    fill = -np.inf if op is np.maximum else np.inf
    table = np.full((num_levels, num), fill, dtype=np.float64)
    table[0] = values
    for level in range(1, num_levels):
        half = 1 << (level - 1)
        table[level, : num - half] = op(table[level - 1, : num - half],
                                        table[level - 1, half:])
    return table


_FLOOR_LOG2 = np.zeros(1, dtype=np.int64)


def range_query(table: np.ndarray, op: np.ufunc, start: np.ndarray, stop: np.ndarray
                ) -> np.ndarray:
    """``op`` over ``values[start:stop]`` for each pair (requires ``start < stop``)."""
    global _FLOOR_LOG2
    length = stop - start
    if len(_FLOOR_LOG2) <= table.shape[1]:
        lengths = np.arange(2 * table.shape[1] + 2)
        _FLOOR_LOG2 = np.zeros(len(lengths), dtype=np.int64)
        _FLOOR_LOG2[1:] = np.floor(np.log2(lengths[1:])).astype(np.int64)
    level = _FLOOR_LOG2[length]
    return op(table[level, start], table[level, stop - (1 << level)])


@dataclass(frozen=True, slots=True)
class Chain:
    """Prefix sums and range tables of a block chain under a training setup."""

    num_blocks: int
    time_prefix: tuple[np.ndarray, np.ndarray]
    """``Q_r``: prefix of F+B+W (+F of checkpointed blocks when r = 1); length n + 1."""
    fwd_prefix: np.ndarray
    """Prefix of the forward that recomputation repeats (checkpointed blocks)."""
    comm_at: np.ndarray
    """``comm(j)`` for j in 0..n."""
    static_prefix: np.ndarray
    act_prefix: tuple[np.ndarray, np.ndarray, np.ndarray]
    transient_table: tuple[np.ndarray, np.ndarray]
    """Range-max tables of transient_0 parts: (block workspace, block activation)."""
    out_table: np.ndarray
    """Range-max table of cut-crossing output bytes (head output zeroed)."""
    cut_out: np.ndarray
    """Cut-crossing output bytes per block (head output zeroed)."""
    num_microbatches: int
    static_ends: tuple[np.ndarray, np.ndarray] | None = None
    """``(at_start, at_end)``: ``static_prefix`` at the start of the module a stage starting
    at block i begins inside and after the module a stage ending before j ends inside
    (``autopart.cost.held``: a module cut into parts is held whole); None when none is cut."""
    cache: dict = field(default_factory=dict)

    @property
    def comm_max(self) -> float:
        """The costliest cut's one-way transfer (0 without cuts)."""
        return float(self.comm_at[1:-1].max()) if self.num_blocks > 1 else 0.0

    def neck_time(self, i: int, j: int, r: int, blocking: bool) -> float:
        """``neck(i, j, r, blocking)`` as defined in the module docstring."""
        q = self.time_prefix[r]
        comm = self.comm_at[j] + (self.comm_max if i > 0 else 0.0) if blocking else 0.0
        return float(q[j] - q[i] + comm)

    @property
    def total_time_ms(self) -> float:
        """F+B+W of every block: the constant part of ``sum_s time``."""
        return float(self.time_prefix[0][-1])

    def stage_time(self, i: int, j: int, r: int) -> float:
        """``time(i, j, r)`` as defined in the module docstring."""
        q = self.time_prefix[r]
        return float(q[j] - q[i] + self.comm_at[j])

    def stage_memory(self, i: int, j: int, r: int, in_flight: int) -> int:
        """``memory(i, j, r, k)`` as defined in the module docstring."""
        mem = self.memory_window(np.array([i]), np.array([j]), r, in_flight)
        return int(mem[0])

    def memory_window(self, i: np.ndarray, j: np.ndarray, r: int, in_flight: int | np.ndarray
                      ) -> np.ndarray:
        """Vectorized ``memory`` for pairs ``i < j``."""
        if self.static_ends is None:
            static = self.static_prefix[j] - self.static_prefix[i]
        else:
            static = self.static_ends[1][j] - self.static_ends[0][i]
        act = self.act_prefix[r][j] - self.act_prefix[r][i]
        work, act_max = self.transient_table
        transient = range_query(work, np.maximum, i, j)
        if r == 1:
            transient = transient + range_query(act_max, np.maximum, i, j)
        m = self.num_microbatches
        buffers = m * range_query(self.out_table, np.maximum, np.maximum(i - 1, 0), j)
        held_out = (m + in_flight) * self.cut_out[j - 1]
        return (static + in_flight * act + transient.astype(np.int64)
                + buffers.astype(np.int64) + held_out.astype(np.int64))

    def lo_memory(self, r: int, in_flight: int, limit_bytes: float | None) -> np.ndarray:
        """For each end j (0..n) the smallest start i whose stage fits; ``j`` if none."""
        key = (r, in_flight, limit_bytes)
        if key not in self.cache:
            self.prepare_lo_memory(r, [in_flight], limit_bytes)
        return self.cache[key]

    def prepare_lo_memory(self, r: int, in_flights: Sequence[int], limit_bytes: float | None
                          ) -> None:
        """Compute ``lo_memory`` for many in-flight counts at once (one vectorized bisection)."""
        todo = sorted({k for k in in_flights if (r, k, limit_bytes) not in self.cache})
        if not todo:
            return
        n = self.num_blocks
        ends = np.tile(np.arange(n + 1), len(todo))
        ks = np.repeat(np.array(todo, dtype=np.int64), n + 1)
        lo = np.zeros(len(ends), dtype=np.int64)
        if limit_bytes is not None:
            hi = ends.copy()
            for _ in range(int(n + 1).bit_length()):
                active = np.flatnonzero(lo < hi)
                if not len(active):
                    break
                mid = (lo[active] + hi[active]) // 2
                fits = self.memory_window(mid, ends[active], r, ks[active]) <= limit_bytes
                hi[active] = np.where(fits, mid, hi[active])
                lo[active] = np.where(fits, lo[active], mid + 1)
        for pos, k in enumerate(todo):
            row = lo[pos * (n + 1):(pos + 1) * (n + 1)].copy()
            row[0] = 0
            self.cache[(r, k, limit_bytes)] = row

    def lo_time(self, r: int, bound_ms: float, blocking: bool, first: bool) -> np.ndarray:
        """For each end j the smallest start i with ``neck(i, j, r, blocking) <= bound_ms``,
        for the first stage (``first``: i = 0, no input cut) or any other (i > 0)."""
        q = self.time_prefix[r]
        bound = bound_ms + _REL_TOL * max(1.0, abs(bound_ms))
        if blocking:
            bound -= 0.0 if first else self.comm_max
            lo = np.searchsorted(q, q + self.comm_at - bound, side="left")
        else:
            lo = np.searchsorted(q, q - bound, side="left")
        return np.minimum(lo, np.arange(self.num_blocks + 1))

    def all_stage_times(self, recompute: bool, blocking: bool = False) -> np.ndarray:
        """Every distinct ``neck`` (both r when ``recompute``), sorted."""
        n = self.num_blocks
        starts, ends = np.triu_indices(n + 1, k=1)
        values = []
        for q in self.time_prefix[:1 + int(recompute)]:
            work = q[ends] - q[starts]
            if blocking:
                work = work + self.comm_at[ends] + np.where(starts > 0, self.comm_max, 0.0)
            values.append(work)
        times = np.unique(np.concatenate(values))
        # Merge values that differ only by rounding (the bounds honour _REL_TOL anyway).
        keep = np.ones(len(times), dtype=bool)
        keep[1:] = np.diff(times) > _REL_TOL * np.maximum(1.0, np.abs(times[1:]))
        return times[keep]


def build_chain(arrays: BlockArrays, setup: TrainingSetup) -> Chain:
    """The solvers' chain of ``arrays`` (from ``cost.stage.block_arrays``) under ``setup``."""
    n = arrays.num_blocks
    step = arrays.fwd_ms + arrays.bwd_input_ms + arrays.bwd_weight_ms
    q0 = np.concatenate([[0.0], np.cumsum(step)])
    q1 = np.concatenate([[0.0], np.cumsum(step)]) + arrays.prefix_recompute_fwd
    comm = np.zeros(n + 1)
    for j in range(1, n):
        comm[j] = comm_ms(int(arrays.output_bytes[j - 1]), setup)
    cut_out = arrays.output_bytes.astype(np.float64).copy()
    cut_out[-1] = 0.0
    logits = np.zeros(n + 1, dtype=np.int64)
    logits[-1] = arrays.held_output_bytes[-1]
    rebuilt = np.where(arrays.checkpointed, arrays.activation_bytes, 0)
    held_for_weight = (np.zeros(n + 1, dtype=np.int64) if arrays.prefix_held_for_weight is None
                       else arrays.prefix_held_for_weight.astype(np.int64))
    return Chain(
        num_blocks=n,
        time_prefix=(q0, q1),
        fwd_prefix=arrays.prefix_recompute_fwd.astype(np.float64),
        comm_at=comm,
        static_prefix=arrays.prefix_static.astype(np.int64),
        static_ends=_static_ends(arrays),
        act_prefix=(arrays.prefix_activation.astype(np.int64) + logits,
                    arrays.prefix_kept.astype(np.int64) + logits,
                    arrays.prefix_activation.astype(np.int64) + logits + held_for_weight),
        transient_table=(range_table(arrays.transient_bytes.astype(np.float64), np.maximum),
                         range_table(rebuilt.astype(np.float64), np.maximum)),
        out_table=range_table(cut_out, np.maximum),
        cut_out=cut_out,
        num_microbatches=setup.num_microbatches,
    )


def _static_ends(arrays: BlockArrays) -> tuple[np.ndarray, np.ndarray] | None:
    """``Chain.static_ends`` from the spans of the modules cut into parts (``autopart.cost.held``;
    None when none is)."""
    if arrays.held is None or arrays.held.span is None:
        return None
    prefix = arrays.prefix_static.astype(np.int64)
    first, last = arrays.held.span
    at_start = np.concatenate([prefix[first], prefix[-1:]])
    at_end = np.concatenate([prefix[:1], prefix[last + 1]])
    return at_start, at_end

"""Event-driven simulation of one training step: step time, idle time, peak memory.

Each rank runs its compute actions (``orders.py``) in order, one at a time. An
action starts when its rank is free and its input has arrived:

- ``F(s, mb)`` needs ``F(s-1, mb)``'s output; ``B(s, mb)`` needs ``B(s+1, mb)``'s
  gradient (the last stage's ``B`` needs its own ``F``); ``W(s, mb)`` needs ``B(s, mb)``.
- A cross-rank transfer takes ``cost.comm_ms(bytes)``: the sender's ``output_bytes``
  for activations, the receiving stage's ``output_bytes`` for gradients (the same
  boundary tensor). A same-rank handoff (V turnaround) is free.
- Sends are asynchronous (no compute time on either rank) but serialize per
  directed link (sender rank -> receiver rank) in the order they are issued. The
  sends of a torch action that the order expands into several parts (a full
  backward ``B W`` in a split schedule, DualPipeV's overlapped ``F B W``) leave when
  its last part ends, as torch's runtime issues them after the whole action.
  Under 1F1B the rank also waits for a steady-state send to end before its next
  action (torch batches it with the next receive and waits on the batch).

Memory per rank (DESIGN.md, ``autopart.cost.stage``): static bytes of its stages + torch's
receive buffers (``rank_cost.recv_buffer_bytes``: an activation and a gradient buffer per
microbatch and stage) + the most bytes held at once during an action. ``F(s, mb)``
holds ``activation_bytes`` of stage ``s`` from its start until the end of the
releasing backward (``B``, or ``W`` in split schedules; between the two it holds
``held_for_weight_bytes`` more); while an action of stage ``s`` runs, its
``transient_bytes`` come on top of what is held (during ``F``, on top of this
microbatch's activations too), less ``adopted_grad_bytes`` except on the stage's
weight-gradient backwards after its first in the step (``F`` and a split ``B``
compute no weight gradients; the first backward's become ``.grad``). torch's action
runtime (every multi-stage schedule) waits its sends only when the step ends, so every
output sent on and every input gradient sent back stays alive until then (GPipe's
backward sends too): from a stage's releasing backward (its output) and its backward
(its input gradient) on, they count on top. Because a rank runs one action at a time
this peak follows from the order alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopart.cost.rank import post_charges_ms, rank_static_bytes, recv_buffer_bytes
from autopart.cost.stage import StageCost, comm_ms
from autopart.errors import PlanError
from autopart.schedules import schedule_info, stage_to_rank
from autopart.schema import TrainingSetup
from autopart.simulate.compiled import KINDS, compiled_plan, held_counts
from autopart.simulate.levels import level_plan
from autopart.simulate.orders import max_in_flight, paused_gc

__all__ = ["SimEvent", "SimResult", "critical_counts", "duration_table", "updated_duration_table",
           "simulate"]



@dataclass(frozen=True, slots=True)
class SimEvent:
    """One compute action (``F``, ``B``, ``W``) or one transfer (``SEND``) in time."""

    rank: int
    """The rank that computes, or the sending rank for ``SEND``."""
    stage_idx: int
    """The computing stage, or the sending stage for ``SEND``."""
    microbatch_idx: int
    kind: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one simulated training step looks like."""

    step_ms: float
    """When the last action on any rank ends (all ranks start at 0)."""
    rank_busy_ms: tuple[float, ...]
    """Sum of compute durations per rank."""
    rank_idle_ms: tuple[float, ...]
    """``step_ms - busy`` per rank."""
    bubble_fraction: float
    """Mean over ranks of ``idle / step``."""
    rank_peak_memory_bytes: tuple[int, ...]
    stage_max_in_flight: tuple[int, ...]
    """Per stage, the most microbatches whose activations it holds at once."""
    events: tuple[SimEvent, ...]
    """Compute events (each rank's in its run order, ranks interleaved), then the sends;
    empty when ``simulate`` ran with ``record_events=False``."""


def simulate(stage_costs: Sequence[StageCost], *, schedule: str, pp_size: int,
             virtual_stages: int, num_microbatches: int, setup: TrainingSetup,
             record_events: bool = True) -> SimResult:
    """Simulate one step of ``schedule`` over stages costing ``stage_costs``.

    ``stage_costs[s]`` is stage ``s``; ``len(stage_costs)`` must be
    ``pp_size * virtual_stages``. Only the link figures of ``setup`` are read (the
    explicit ``pp_size`` and ``num_microbatches`` win, so a search can vary them).
    ``record_events=False`` leaves ``events`` empty and runs the vectorized
    recurrences (``levels.py``) instead of the event loop: the same figures, many
    times faster on large pipelines. Raises ``PlanError`` on inconsistent settings
    or negative durations.
    """
    if not record_events:
        return simulate_batch([stage_costs], schedule=schedule, pp_size=pp_size,
                              virtual_stages=virtual_stages,
                              num_microbatches=num_microbatches, setup=setup)[0]
    _check_costs(stage_costs, pp_size, virtual_stages)
    info = schedule_info(schedule)
    with paused_gc():
        plan = compiled_plan(schedule, pp_size, virtual_stages, num_microbatches)
        events: list[tuple] = []
        charges = post_charges_ms(setup, schedule, pp_size, virtual_stages)
        busy, step_ms = run_compiled(plan, _durations(stage_costs, info.split_backward, charges),
                                     _comm_times(stage_costs, setup), pp_size * virtual_stages,
                                     num_microbatches, events)
        return _result(stage_costs, schedule, pp_size, virtual_stages, num_microbatches,
                       busy, step_ms, events)


def simulate_batch(batch: Sequence[Sequence[StageCost]], *, schedule: str, pp_size: int,
                   virtual_stages: int, num_microbatches: int, setup: TrainingSetup
                   ) -> list[SimResult]:
    """Simulate several splits of one configuration at once (no events).

    Each item of ``batch`` is a ``stage_costs`` list as in ``simulate``; the results
    are exactly ``simulate(..., record_events=False)``'s, one per item, computed in
    one vectorized pass over the step's recurrences (``levels.py``). Raises
    ``PlanError`` as ``simulate`` does.
    """
    for stage_costs in batch:
        _check_costs(stage_costs, pp_size, virtual_stages)
    if not batch:
        return []
    split = schedule_info(schedule).split_backward
    charges = post_charges_ms(setup, schedule, pp_size, virtual_stages)
    with paused_gc():
        levels = level_plan(schedule, pp_size, virtual_stages, num_microbatches)
        table = np.stack([duration_table(costs, split, setup, charges) for costs in batch],
                         axis=1)
        busy, step = levels.run(table)
        peaks = _peak_memory(batch, schedule, pp_size, virtual_stages, num_microbatches)
        return [_result(costs, schedule, pp_size, virtual_stages, num_microbatches,
                        busy[:, k].tolist(), float(step[k]), None, peaks[k])
                for k, costs in enumerate(batch)]


def duration_table(stage_costs: Sequence[StageCost], split_backward: bool,
                   setup: TrainingSetup, charges: Sequence[float] | None = None) -> np.ndarray:
    """The recurrences' durations of one split: per stage F, B, W, then the activation
    send and the gradient send, as ``5 * num_stages`` values (``levels.py``); ``charges``:
    the schedule's per-stage ms on each F and B (``rank_cost.post_charges_ms``)."""
    rows = (*_durations(stage_costs, split_backward, charges), *_comm_times(stage_costs, setup))
    return np.array([x for row in rows for x in row], dtype=np.float64)


def updated_duration_table(table: np.ndarray, stage_costs: Sequence[StageCost],
                           stages: Sequence[int], split_backward: bool,
                           setup: TrainingSetup, charges: Sequence[float] | None = None
                           ) -> np.ndarray:
    """``duration_table(stage_costs, ...)`` from another split's ``table`` when only
    ``stages`` changed: their rows (and the next stage's gradient send) are rewritten."""
    out = table.copy()
    num = len(stage_costs)
    for s in stages:
        sc = stage_costs[s]
        extra = charges[s] if charges is not None else 0.0
        out[s] = sc.fwd_ms + extra
        out[num + s] = extra + (sc.bwd_input_ms if split_backward
                                else sc.bwd_input_ms + sc.bwd_weight_ms)
        out[2 * num + s] = sc.bwd_weight_ms + sc.split_extra_ms if split_backward else 0.0
        out[3 * num + s] = comm_ms(sc.output_bytes, setup)
        if s + 1 < num:
            out[4 * num + s + 1] = comm_ms(sc.output_bytes, setup)
    return out


def critical_counts(stage_costs: Sequence[StageCost], *, schedule: str, pp_size: int,
                    virtual_stages: int, num_microbatches: int, setup: TrainingSetup
                    ) -> np.ndarray:
    """How often each ``duration_table`` entry lies on one critical path of the step.

    The path's durations add up to the step, so for any other split of the same
    configuration ``counts @ duration_table(other)`` is a lower bound on its step:
    a local search skips moves that cannot beat the current step without
    simulating them. Raises ``PlanError`` as ``simulate`` does.
    """
    _check_costs(stage_costs, pp_size, virtual_stages)
    split = schedule_info(schedule).split_backward
    charges = post_charges_ms(setup, schedule, pp_size, virtual_stages)
    with paused_gc():
        levels = level_plan(schedule, pp_size, virtual_stages, num_microbatches)
        return levels.critical_counts(duration_table(stage_costs, split, setup, charges))


def _check_costs(stage_costs: Sequence[StageCost], pp_size: int, virtual_stages: int) -> None:
    num_stages = pp_size * virtual_stages
    if len(stage_costs) != num_stages:
        raise PlanError(f"got {len(stage_costs)} stage costs, expected pp_size * "
                        f"virtual_stages = {pp_size} * {virtual_stages} = {num_stages}")
    for idx, sc in enumerate(stage_costs):
        if min(sc.fwd_ms, sc.bwd_input_ms, sc.bwd_weight_ms) < 0:
            raise PlanError(f"stage {idx} has a negative duration ({sc}); "
                            "check the profile")


def _result(stage_costs: Sequence[StageCost], schedule: str, pp_size: int,
            virtual_stages: int, num_microbatches: int, busy: Sequence[float],
            step_ms: float, events: list[tuple] | None,
            peaks: tuple[int, ...] | None = None) -> SimResult:
    """The ``SimResult`` of a run: idle and bubble follow from busy and step, memory from
    the order (``peaks``: the rank peaks when computed already, ``_peak_memory``)."""
    idle = tuple(step_ms - b for b in busy)
    bubble = sum(idle) / (pp_size * step_ms) if step_ms > 0 else 0.0
    return SimResult(
        step_ms=step_ms,
        rank_busy_ms=tuple(busy),
        rank_idle_ms=idle,
        bubble_fraction=bubble,
        rank_peak_memory_bytes=peaks if peaks is not None else _peak_memory(
            [stage_costs], schedule, pp_size, virtual_stages, num_microbatches)[0],
        stage_max_in_flight=tuple(max_in_flight(schedule, pp_size, virtual_stages,
                                                 num_microbatches)),
        events=tuple(SimEvent(*e) for e in events) if events else (),
    )


def _durations(stage_costs: Sequence[StageCost], split: bool,
               charges: Sequence[float] | None = None) -> tuple[list[float], ...]:
    """Per kind (F, B, W), per stage duration; a non-split ``B`` is the full backward, a
    split ``W`` carries what torch's split backward adds (``StageCost.split_extra_ms``);
    ``charges``: per stage ms added to its F and its B (the sends and receives they post
    under torch's action runtime, ``rank_cost.post_charges_ms``)."""
    extra = charges if charges is not None else [0.0] * len(stage_costs)
    fwd = [sc.fwd_ms + x for sc, x in zip(stage_costs, extra)]
    if split:
        return fwd, [sc.bwd_input_ms + x for sc, x in zip(stage_costs, extra)], \
            [sc.bwd_weight_ms + sc.split_extra_ms for sc in stage_costs]
    return (fwd, [sc.bwd_input_ms + sc.bwd_weight_ms + x for sc, x in zip(stage_costs, extra)],
            [0.0] * len(fwd))


def _comm_times(stage_costs: Sequence[StageCost], setup: TrainingSetup) -> list[list[float]]:
    """``[activation send of stage s, gradient send of stage s to s-1]`` in ms."""
    act = [comm_ms(sc.output_bytes, setup) for sc in stage_costs]
    grad = [0.0] + [comm_ms(stage_costs[s - 1].output_bytes, setup)
                    for s in range(1, len(stage_costs))]
    return [act, grad]


def run_compiled(plan, durations, comms, num_stages: int, m: int,
                 events: list[tuple] | None) -> tuple[list[float], float]:
    """Advance every rank as far as its inputs allow; wake a rank when its input lands.

    Returns per-rank busy time and the step time; appends compute events, then
    sends, to ``events`` when given.
    """
    num_ranks = len(plan)
    avail: list[float | None] = [None] * (3 * num_stages * m)
    waiting: dict[int, int] = {}
    pos, clock, busy = [0] * num_ranks, [0.0] * num_ranks, [0.0] * num_ranks
    pending: list[list[tuple]] = [[] for _ in range(num_ranks)]
    link_free: dict[tuple[int, int], float] = {}
    sends: list[tuple] = []
    stack = list(range(num_ranks - 1, -1, -1))
    while stack:
        rank = stack.pop()
        row, i, t, work = plan[rank], pos[rank], clock[rank], busy[rank]
        while i < len(row):
            kind, s, mb, deps, local, send, table, dst, flush = row[i]
            start = t
            for d in deps:
                at = avail[d]
                if at is None:
                    waiting[d] = rank
                    break
                start = max(start, at)
            else:
                dur = durations[kind][s]
                t = start + dur
                work += dur
                if events is not None:
                    events.append((rank, s, mb, KINDS[kind], start, t))
                for c in local:
                    avail[c] = t
                    if c in waiting:
                        stack.append(waiting.pop(c))
                if send >= 0:
                    pending[rank].append((send, table, s, mb, dst))
                if flush and pending[rank]:
                    sent = _flush(pending[rank], rank, t, comms, link_free, avail, waiting,
                                  stack, sends)
                    if flush == 2:  # the rank waits for its sends (1F1B's batched p2p)
                        t = max(t, sent)
                i += 1
                continue
            break
        pos[rank], clock[rank], busy[rank] = i, t, work
    _assert_finished(plan, pos, waiting, num_stages, m)
    if events is not None:
        events.extend(sends)
    return busy, max(clock, default=0.0)


def _flush(pending: list[tuple], rank: int, t: float, comms, link_free, avail, waiting,
           stack: list[int], sends: list[tuple]) -> float:
    """Issue a group's sends at ``t``; each directed link carries one transfer at a time.

    Returns when the last of them ends."""
    last = t
    for code, table, s, mb, dst in pending:
        link = (rank, dst)
        start = max(t, link_free.get(link, 0.0))
        end = start + comms[table][s]
        link_free[link] = end
        sends.append((rank, s, mb, "SEND", start, end))
        avail[code] = end
        last = max(last, end)
        if code in waiting:
            stack.append(waiting.pop(code))
    pending.clear()
    return last


def _assert_finished(plan, pos: list[int], waiting: dict[int, int], num_stages: int,
                     m: int) -> None:
    """Internal invariant: the torch/generated orders never deadlock."""
    stuck = {}
    for rank, row in enumerate(plan):
        if pos[rank] < len(row):
            kind, s, mb = row[pos[rank]][:3]
            missing = [divmod(divmod(c, m)[0], num_stages) + (c % m,)
                       for c, r in waiting.items() if r == rank]
            stuck[rank] = f"{KINDS[kind]}{mb} s{s} waits on (table, stage, mb) {missing}"
    assert not stuck, f"schedule deadlocked: {stuck}"


def _sent_bytes(stage_costs: Sequence[StageCost], stages: Sequence[int], schedule: str,
                pp_size: int, virtual_stages: int) -> tuple[list[int], list[int]]:
    """Per stage of a rank, the bytes each backward done and each releasing backward done
    leave alive until the step ends: torch's action runtime (every multi-stage schedule)
    waits its sends only then, so a gradient sent back and an output sent on stay held by
    the send; GPipe waits its backward sends then too. 1F1B waits each send before its
    next action."""
    info = schedule_info(schedule)
    if not info.multi_stage and schedule != "gpipe":
        return [0] * len(stages), [0] * len(stages)
    last = pp_size * virtual_stages - 1
    rank = [stage_to_rank(s, pp_size, virtual_stages, info.style) for s in range(last + 1)]
    grads = [stage_costs[s].input_bytes if s > 0 and rank[s - 1] != rank[s] else 0
             for s in stages]
    outputs = [stage_costs[s].output_bytes
               if info.multi_stage and s < last and rank[s + 1] != rank[s] else 0
               for s in stages]
    return grads, outputs


def _peak_memory(batch: Sequence[Sequence[StageCost]], schedule: str, pp_size: int,
                 virtual_stages: int, num_microbatches: int) -> list[tuple[int, ...]]:
    """Per split of ``batch``, per rank: static + receive buffers + the most held at once,
    workspace included (all splits at once: one column each)."""
    peaks = np.zeros((len(batch), pp_size), dtype=np.int64)
    for rank, (stages, counts, running, pays) in enumerate(held_counts(
            schedule, pp_size, virtual_stages, num_microbatches)):
        act = _columns(batch, stages, "activation_bytes")
        sent = [_sent_bytes(costs, stages, schedule, pp_size, virtual_stages)
                for costs in batch]
        act = np.concatenate([act, act + _columns(batch, stages, "held_for_weight_bytes"),
                              np.array([grads for grads, _ in sent], dtype=np.int64).T,
                              np.array([outputs for _, outputs in sent], dtype=np.int64).T])
        work = _columns(batch, stages, "transient_bytes")
        adopted = _columns(batch, stages, "adopted_grad_bytes")
        held = counts @ act + work[running] - np.where(pays[:, None], 0, adopted[running])
        peaks[:, rank] = held.max(axis=0) + np.array(
            [rank_static_bytes(costs, stages)
             + sum(recv_buffer_bytes(costs[s], num_microbatches) for s in stages)
             for costs in batch], dtype=np.int64)
    return [tuple(int(x) for x in row) for row in peaks]


def _columns(batch: Sequence[Sequence[StageCost]], stages: Sequence[int], field: str
             ) -> np.ndarray:
    """``(len(stages), len(batch))``: the ``StageCost`` field of each stage of each split."""
    return np.array([[getattr(costs[s], field) for costs in batch] for s in stages],
                    dtype=np.int64)

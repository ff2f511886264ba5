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
  its last part ends, and that action waits until all its parts' inputs arrived,
  as torch's runtime does.

Memory per rank (DESIGN.md): static bytes of its stages + the largest transient
workspace + boundary buffers (one ``input_bytes`` and one ``output_bytes`` per
stage, an approximation of torch's preallocated recv buffers) + the most
activation bytes held at once. ``F(s, mb)`` holds ``activation_bytes`` of stage
``s`` from its start until the end of the releasing backward (``B``, or ``W`` in
split schedules). Because a rank runs one action at a time this peak follows from
the order alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from autopart.cost import StageCost, comm_ms
from autopart.errors import PlanError
from autopart.schedules import schedule_info, stage_to_rank
from autopart.schema import TrainingSetup
from autopart.simulate.orders import _groups, max_in_flight

__all__ = ["SimEvent", "SimResult", "simulate"]

_KINDS = ("F", "B", "W")
# Dependency codes: (table * num_stages + stage) * m + mb, tables below.
_ACT, _GRAD, _BDONE = 0, 1, 2
_NO_DST = -1


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
    """Compute events of every rank in order, then the sends."""


def simulate(stage_costs: Sequence[StageCost], *, schedule: str, pp_size: int,
             virtual_stages: int, num_microbatches: int,
             setup: TrainingSetup) -> SimResult:
    """Simulate one step of ``schedule`` over stages costing ``stage_costs``.

    ``stage_costs[s]`` is stage ``s``; ``len(stage_costs)`` must be
    ``pp_size * virtual_stages``. Only the link figures of ``setup`` are read (the
    explicit ``pp_size`` and ``num_microbatches`` win, so a search can vary them).
    Raises ``PlanError`` on inconsistent settings or negative durations.
    """
    num_stages = pp_size * virtual_stages
    if len(stage_costs) != num_stages:
        raise PlanError(f"got {len(stage_costs)} stage costs, expected pp_size * "
                        f"virtual_stages = {pp_size} * {virtual_stages} = {num_stages}")
    for idx, sc in enumerate(stage_costs):
        if min(sc.fwd_ms, sc.bwd_input_ms, sc.bwd_weight_ms) < 0:
            raise PlanError(f"stage {idx} has a negative duration ({sc}); "
                            "check the profile")
    plan = _compiled(schedule, pp_size, virtual_stages, num_microbatches)
    split = schedule_info(schedule).split_backward
    durations = _durations(stage_costs, split)
    comms = _comm_times(stage_costs, setup)
    raw, ends = _run(plan, durations, comms, pp_size, num_stages, num_microbatches)
    step_ms = max(ends) if ends else 0.0
    busy = [0.0] * pp_size
    for rank, _, _, kind, start, end in raw:
        if kind != "SEND":
            busy[rank] += end - start
    idle = tuple(step_ms - b for b in busy)
    bubble = sum(idle) / (pp_size * step_ms) if step_ms > 0 else 0.0
    return SimResult(
        step_ms=step_ms,
        rank_busy_ms=tuple(busy),
        rank_idle_ms=idle,
        bubble_fraction=bubble,
        rank_peak_memory_bytes=_peak_memory(stage_costs, schedule, pp_size, virtual_stages,
                                            num_microbatches),
        stage_max_in_flight=tuple(max_in_flight(schedule, pp_size, virtual_stages,
                                                num_microbatches)),
        events=tuple(SimEvent(*e) for e in raw),
    )


def _durations(stage_costs: Sequence[StageCost], split: bool) -> tuple[list[float], ...]:
    """Per kind (F, B, W), per stage duration; a non-split ``B`` is the full backward."""
    fwd = [sc.fwd_ms for sc in stage_costs]
    if split:
        return fwd, [sc.bwd_input_ms for sc in stage_costs], [sc.bwd_weight_ms
                                                               for sc in stage_costs]
    return fwd, [sc.bwd_input_ms + sc.bwd_weight_ms for sc in stage_costs], [0.0] * len(fwd)


def _comm_times(stage_costs: Sequence[StageCost], setup: TrainingSetup) -> list[list[float]]:
    """``[activation send of stage s, gradient send of stage s to s-1]`` in ms."""
    act = [comm_ms(sc.output_bytes, setup) for sc in stage_costs]
    grad = [0.0] + [comm_ms(stage_costs[s - 1].output_bytes, setup)
                    for s in range(1, len(stage_costs))]
    return [act, grad]


@lru_cache(maxsize=256)
def _compiled(schedule: str, pp_size: int, virtual_stages: int, num_microbatches: int
              ) -> tuple[tuple[tuple, ...], ...]:
    """Per rank, each action as ``(kind_idx, stage, mb, deps, local_out, send_out,
    send_table, dst_rank, flush)`` with integer dependency codes; cached."""
    style = schedule_info(schedule).style
    num_stages = pp_size * virtual_stages
    m = num_microbatches
    rank_of = [stage_to_rank(s, pp_size, virtual_stages, style) for s in range(num_stages)]

    def code(table: int, stage: int, mb: int) -> int:
        return (table * num_stages + stage) * m + mb

    rows = []
    for rank, groups in enumerate(_groups(schedule, pp_size, virtual_stages, m)):
        row = []
        for grp in groups:
            internal = {code(_BDONE, s, mb) for kind, s, mb in grp if kind == "B"}
            internal |= {code(_ACT, s, mb) for kind, s, mb in grp
                         if kind == "F" and s + 1 < num_stages and rank_of[s + 1] == rank}
            group_deps: list[int] = []
            parts = []
            for pos, (kind, s, mb) in enumerate(grp):
                if kind == "F":
                    dep = code(_ACT, s - 1, mb) if s > 0 else None
                    target, table = s + 1, _ACT
                elif kind == "B":
                    dep = (code(_GRAD, s + 1, mb) if s + 1 < num_stages
                           else code(_ACT, s, mb))
                    target, table = s - 1, _GRAD
                else:
                    dep, target, table = code(_BDONE, s, mb), -1, _ACT
                deps = () if dep is None else (dep,)
                group_deps += [d for d in deps if d not in internal]
                local, send, dst = _outputs(kind, s, mb, target, table, rank, rank_of,
                                            num_stages, code)
                parts.append([_KINDS.index(kind), s, mb, deps, local, send, table, dst,
                              pos == len(grp) - 1])
            parts[0][3] = tuple(dict.fromkeys(group_deps))
            row.extend(tuple(p) for p in parts)
        rows.append(tuple(row))
    return tuple(rows)


def _outputs(kind: str, s: int, mb: int, target: int, table: int, rank: int,
             rank_of: list[int], num_stages: int, code) -> tuple[tuple[int, ...], int, int]:
    """What an action makes available: local codes (at its end) and one cross-rank send."""
    local: list[int] = []
    if kind == "B":
        local.append(code(_BDONE, s, mb))
    if kind == "F" and s == num_stages - 1:
        local.append(code(_ACT, s, mb))  # the last stage's B waits on its own F
    send, dst = -1, _NO_DST
    if kind != "W" and 0 <= target < num_stages:
        if rank_of[target] == rank:
            local.append(code(table, s, mb))
        else:
            send, dst = code(table, s, mb), rank_of[target]
    return tuple(local), send, dst


def _run(plan, durations, comms, pp_size: int, num_stages: int, m: int):
    """Advance every rank as far as its inputs allow; wake ranks when inputs arrive."""
    avail: list[float | None] = [None] * (3 * num_stages * m)
    waiting: dict[int, int] = {}
    pos = [0] * pp_size
    clock = [0.0] * pp_size
    pending: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(pp_size)]
    link_free: dict[tuple[int, int], float] = {}
    raw: list[tuple] = []
    sends: list[tuple] = []
    ends: list[float] = []
    stack = list(range(pp_size - 1, -1, -1))
    while stack:
        rank = stack.pop()
        row, i, t = plan[rank], pos[rank], clock[rank]
        while i < len(row):
            kind, s, mb, deps, local, send, table, dst, flush = row[i]
            ready = t
            blocked = False
            for d in deps:
                at = avail[d]
                if at is None:
                    waiting[d] = rank
                    blocked = True
                    break
                if at > ready:
                    ready = at
            if blocked:
                break
            t = ready + durations[kind][s]
            raw.append((rank, s, mb, _KINDS[kind], ready, t))
            for c in local:
                avail[c] = t
                if c in waiting:
                    stack.append(waiting.pop(c))
            if send >= 0:
                pending[rank].append((send, table, s, mb, dst))
            if flush and pending[rank]:
                for c, tab, ss, mbb, to in pending[rank]:
                    link = (rank, to)
                    start = max(t, link_free.get(link, 0.0))
                    end = start + comms[tab][ss]
                    link_free[link] = end
                    sends.append((rank, ss, mbb, "SEND", start, end))
                    avail[c] = end
                    if c in waiting:
                        stack.append(waiting.pop(c))
                pending[rank].clear()
            i += 1
        pos[rank], clock[rank] = i, t
        if i == len(row):
            ends.append(t)
    _assert_finished(plan, pos, waiting, num_stages, m)
    return raw + sends, ends


def _assert_finished(plan, pos: list[int], waiting: dict[int, int], num_stages: int,
                     m: int) -> None:
    """Internal invariant: the torch/generated orders never deadlock."""
    stuck = {}
    for rank, row in enumerate(plan):
        if pos[rank] < len(row):
            kind, s, mb = row[pos[rank]][:3]
            missing = [divmod(divmod(c, m)[0], num_stages) + (c % m,)
                       for c, r in waiting.items() if r == rank]
            stuck[rank] = f"{_KINDS[kind]}{mb} s{s} waits on (table, stage, mb) {missing}"
    assert not stuck, f"schedule deadlocked: {stuck}"


def _peak_memory(stage_costs: Sequence[StageCost], schedule: str, pp_size: int,
                 virtual_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Per rank: static + largest transient + boundary buffers + peak activations held."""
    info = schedule_info(schedule)
    release = "W" if info.split_backward else "B"
    peaks = []
    for rank, groups in enumerate(_groups(schedule, pp_size, virtual_stages,
                                          num_microbatches)):
        stages = [s for s in range(pp_size * virtual_stages)
                  if stage_to_rank(s, pp_size, virtual_stages, info.style) == rank]
        held = peak = 0
        for grp in groups:
            for kind, s, _ in grp:
                if kind == "F":
                    held += stage_costs[s].activation_bytes
                    peak = max(peak, held)
                elif kind == release:
                    held -= stage_costs[s].activation_bytes
        base = sum(stage_costs[s].static_bytes + stage_costs[s].input_bytes
                   + stage_costs[s].output_bytes for s in stages)
        peaks.append(base + max(stage_costs[s].transient_bytes for s in stages) + peak)
    return tuple(peaks)

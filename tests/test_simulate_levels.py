"""The vectorized recurrences (``simulate/levels.py``) against the event engine.

The event engine (``record_events=True``) is the reference: on random schedules,
sizes, durations, boundary bytes and links the fast path must give the very same
floats (step, busy, idle, bubble) and the same per-rank peaks, alone and batched.
"""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules  # noqa: F401  (torch's import cost at collection)
from hypothesis import given, settings
from hypothesis import strategies as st

from autopart.cost.stage import StageCost
from autopart.errors import PlanError
from autopart.schedules import SCHEDULES, check_schedule
from autopart.schema import TrainingSetup
from autopart.simulate import simulate
from autopart.simulate._compiled_arrays import compiled_arrays
from autopart.simulate.compiled import compiled_plan
from autopart.simulate.engine import simulate_batch

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@st.composite
def configs(draw):
    """A schedule with pp, v and m that torch accepts."""
    name = draw(st.sampled_from(list(SCHEDULES)))
    info = SCHEDULES[name]
    pp = draw(st.integers(1, 4))
    v = info.fixed_virtual_stages or draw(st.integers(2, 3))
    m = draw(st.integers(1, 9))
    try:
        check_schedule(name, pp, v, m)
    except PlanError:
        m = pp * v
    return name, pp, v, m


@st.composite
def stage_costs(draw, num_stages: int):
    return [StageCost(fwd_ms=draw(times), bwd_input_ms=draw(times), bwd_weight_ms=draw(times),
                      static_bytes=draw(st.integers(0, 10**9)),
                      activation_bytes=draw(st.integers(0, 10**9)),
                      input_bytes=draw(st.integers(0, 10**6)),
                      output_bytes=draw(st.integers(0, 5 * 10**6)),
                      transient_bytes=draw(st.integers(0, 10**6)), param_count=0)
            for _ in range(num_stages)]


@st.composite
def problems(draw):
    name, pp, v, m = draw(configs())
    setup = TrainingSetup(pp_size=1, num_microbatches=1,
                          link_latency_ms=draw(st.sampled_from([0.0, 0.01, 0.3])),
                          link_bandwidth_bytes_per_s=draw(st.sampled_from([1e8, 1e9, 5e10])))
    batch = [draw(stage_costs(pp * v)) for _ in range(draw(st.integers(1, 3)))]
    return (name, pp, v, m), setup, batch


def _figures(res):
    return (res.step_ms, res.rank_busy_ms, res.rank_idle_ms, res.bubble_fraction,
            res.rank_peak_memory_bytes, res.stage_max_in_flight)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_fast_path_equals_event_engine_exactly(problem) -> None:
    """Identical floats and bytes, alone (record_events=False) and batched."""
    (name, pp, v, m), setup, batch = problem
    kw = dict(schedule=name, pp_size=pp, virtual_stages=v, num_microbatches=m, setup=setup)
    reference = [_figures(simulate(costs, record_events=True, **kw)) for costs in batch]
    alone = [_figures(simulate(costs, record_events=False, **kw)) for costs in batch]
    assert alone == reference
    assert [_figures(r) for r in simulate_batch(batch, **kw)] == reference


def test_fast_path_on_a_large_interleaved_pipeline() -> None:
    """pp 8, v 4, m 16 with unequal stages and a slow link: still identical."""
    costs = [StageCost(fwd_ms=1.0 + 0.37 * s % 2.3, bwd_input_ms=2.0 + 0.11 * s,
                       bwd_weight_ms=0.5 + 0.05 * (s % 7), static_bytes=s, activation_bytes=3 * s,
                       input_bytes=0, output_bytes=1_000_000 + 1000 * s, transient_bytes=0,
                       param_count=0) for s in range(32)]
    setup = TrainingSetup(pp_size=1, num_microbatches=1, link_latency_ms=0.02,
                          link_bandwidth_bytes_per_s=2e9)
    for name in ("interleaved-1f1b", "interleaved-zb", "looped-bfs"):
        kw = dict(schedule=name, pp_size=8, virtual_stages=4, num_microbatches=16, setup=setup)
        assert (_figures(simulate(costs, record_events=False, **kw))
                == _figures(simulate(costs, **kw)))


def test_batch_checks_every_item() -> None:
    """A wrong stage count anywhere in the batch is the same PlanError as alone."""
    setup = TrainingSetup(pp_size=1, num_microbatches=1)
    good = [StageCost(1.0, 1.0, 1.0, 0, 0, 0, 0, 0, 0)] * 2
    with pytest.raises(PlanError, match="expected pp_size"):
        simulate_batch([good, good[:1]], schedule="1f1b", pp_size=2, virtual_stages=1,
                       num_microbatches=2, setup=setup)
    assert simulate_batch([], schedule="1f1b", pp_size=2, virtual_stages=1,
                          num_microbatches=2, setup=setup) == []


def _rows_of(plan) -> list[list[tuple]]:
    """``compiled_plan``'s tuples in ``compiled_arrays``' columns (deps, outputs padded)."""
    out = []
    for row in plan:
        rows = []
        for kind, s, mb, deps, local, send, table, dst, flush in row:
            local = (*local, -1, -1)[:2]
            rows.append((kind, s, mb, deps[0] if deps else -1, *local, send, table, dst,
                         int(flush)))
        out.append(rows)
    return out


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_compiled_arrays_equal_the_engine_tuples(name):
    """The arrays the level simulator and the memory moments read hold, action by action,
    the fields of the event engine's compiled order (1F1B's waited-on sends included)."""
    info = SCHEDULES[name]
    for pp, v, m in ((1, 2, 3), (2, 2, 4), (3, 3, 5), (4, 2, 8)):
        v = info.fixed_virtual_stages or v
        try:
            check_schedule(name, pp, v, m)
        except PlanError:
            continue
        got = [rows.tolist() for rows in compiled_arrays(name, pp, v, m)]
        assert got == [[list(r) for r in rows] for rows in _rows_of(compiled_plan(name, pp, v, m))]

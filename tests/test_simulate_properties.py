"""Property tests of autopart.simulate.simulate over random stage costs (hypothesis).

With fixed per-rank orders every start time is a max-plus expression of the
durations, so the checks compare against that structure: dependencies respected,
ranks run one action at a time in their order, the step is monotone in every
duration, and scaling every time scales the step.
Run: /work/venv/bin/pytest tests/test_simulate_properties.py
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch.distributed.pipelining.schedules  # noqa: F401  (torch's import cost at collection)
from hypothesis import given, settings
from hypothesis import strategies as st

from autopart.cost.stage import StageCost, comm_ms
from autopart.schedules import schedule_info, stage_to_rank
from autopart.schema import TrainingSetup
from autopart.simulate import rank_orders, simulate

CASES = [("gpipe", 2, 1, 3), ("1f1b", 3, 1, 5), ("interleaved-1f1b", 2, 2, 4),
         ("looped-bfs", 3, 2, 3), ("interleaved-zb", 2, 3, 4), ("zbv", 3, 2, 4),
         ("dualpipev", 2, 2, 5)]
SETUP = TrainingSetup(pp_size=1, num_microbatches=1, link_latency_ms=0.0,
                      link_bandwidth_bytes_per_s=1e9)

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@st.composite
def problems(draw):
    """A schedule case and random per-stage times and boundary sizes."""
    case = draw(st.sampled_from(CASES))
    num_stages = case[1] * case[2]
    costs = [StageCost(fwd_ms=draw(times), bwd_input_ms=draw(times), bwd_weight_ms=draw(times),
                       static_bytes=0, activation_bytes=draw(st.integers(0, 100)),
                       input_bytes=0, output_bytes=draw(st.integers(0, 5_000_000)),
                       transient_bytes=0, param_count=0)
             for _ in range(num_stages)]
    return case, costs


def _simulate(case, costs):
    schedule, pp, v, m = case
    return simulate(costs, schedule=schedule, pp_size=pp, virtual_stages=v, num_microbatches=m,
                    setup=SETUP)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_events_respect_orders_and_dependencies(problem) -> None:
    """Compared with the orders and the dependency rules the engine documents."""
    (schedule, pp, v, m), costs = problem
    res = _simulate((schedule, pp, v, m), costs)
    info = schedule_info(schedule)
    compute = [e for e in res.events if e.kind != "SEND"]
    done = {(e.kind, e.stage_idx, e.microbatch_idx): e for e in compute}
    last = pp * v - 1
    for rank, order in enumerate(rank_orders(schedule, pp, v, m)):
        mine = [e for e in compute if e.rank == rank]
        assert [(e.kind, e.stage_idx, e.microbatch_idx) for e in mine] == [
            (a.kind, a.stage_idx, a.microbatch_idx) for a in order]
        assert all(a.end_ms <= b.start_ms + 1e-9 for a, b in itertools.pairwise(mine))
    for (kind, s, mb), ev in done.items():
        if kind == "F" and s > 0:
            dep, nbytes = done[("F", s - 1, mb)], costs[s - 1].output_bytes
        elif kind == "B":
            dep, nbytes = (done[("B", s + 1, mb)] if s < last else done[("F", s, mb)],
                           costs[s].output_bytes)
        elif kind == "W":
            dep, nbytes = done[("B", s, mb)], 0
        else:
            continue
        same = dep.rank == ev.rank
        assert ev.start_ms >= dep.end_ms + (0.0 if same else comm_ms(nbytes, SETUP)) - 1e-9
    assert res.step_ms == pytest.approx(max((e.end_ms for e in compute), default=0.0))
    assert all(i >= -1e-9 for i in res.rank_idle_ms)
    assert all(stage_to_rank(e.stage_idx, pp, v, info.style) == e.rank for e in compute)


@settings(max_examples=60, deadline=None)
@given(problems(), st.data())
def test_step_is_monotone_and_scales(problem, data) -> None:
    """A slower stage never speeds the step up; doubling every time doubles it."""
    case, costs = problem
    base = _simulate(case, costs).step_ms
    idx = data.draw(st.integers(0, len(costs) - 1))
    field = data.draw(st.sampled_from(["fwd_ms", "bwd_input_ms", "bwd_weight_ms"]))
    slower = list(costs)
    slower[idx] = dataclasses.replace(costs[idx], **{field: getattr(costs[idx], field) + 1.0})
    assert _simulate(case, slower).step_ms >= base - 1e-9
    doubled = [dataclasses.replace(c, fwd_ms=2 * c.fwd_ms, bwd_input_ms=2 * c.bwd_input_ms,
                                   bwd_weight_ms=2 * c.bwd_weight_ms,
                                   output_bytes=2 * c.output_bytes) for c in costs]
    assert _simulate(case, doubled).step_ms == pytest.approx(2 * base)

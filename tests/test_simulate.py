"""Tests of autopart.simulate: closed-form step times, in-flight counts, memory, traces.

Run: /work/venv/bin/pytest tests/test_simulate.py
"""

from __future__ import annotations

import json

import pytest
import torch.distributed.pipelining.schedules  # noqa: F401  (torch's import cost at collection)

from autopart.cost.stage import StageCost
from autopart.errors import PlanError
from autopart.schedules import schedule_info, stage_to_rank
from autopart.schema import TrainingSetup
from autopart.simulate import (
    chrome_trace,
    max_in_flight,
    rank_orders,
    render_timeline,
    simulate,
    write_trace,
)
from autopart.simulate.compiled import compile_action
from autopart.simulate.engine import run_compiled, simulate_batch

NO_LATENCY = TrainingSetup(pp_size=1, num_microbatches=1, link_latency_ms=0.0,
                           link_bandwidth_bytes_per_s=1e9)
"""1e6 bytes take exactly 1 ms on this link."""


def stage(fwd: float = 1.0, bwd_input: float = 1.0, bwd_weight: float = 1.0,
          output_bytes: int = 0, **kw: int) -> StageCost:
    """A stage with the given times; memory figures default to small distinct numbers."""
    mem = {"static_bytes": 1000, "activation_bytes": 100, "input_bytes": 7,
           "transient_bytes": 30} | kw
    return StageCost(fwd_ms=fwd, bwd_input_ms=bwd_input, bwd_weight_ms=bwd_weight,
                     output_bytes=output_bytes, param_count=1, **mem)


def run(schedule: str, pp: int, v: int, m: int, setup: TrainingSetup = NO_LATENCY,
        **stage_kw: float):
    """Simulate ``schedule`` with ``pp * v`` identical stages."""
    return simulate([stage(**stage_kw)] * (pp * v), schedule=schedule, pp_size=pp,
                    virtual_stages=v, num_microbatches=m, setup=setup)


# --- exact step times ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), [(2, 2), (2, 5), (4, 4), (4, 8), (4, 12), (8, 8)])
def test_one_stage_schedules_closed_form(schedule: str, pp: int, m: int) -> None:
    """GPipe and 1F1B, equal stages, no comm: step = (m + p - 1)(F + B), B the full backward."""
    res = run(schedule, pp, 1, m, fwd=1.0, bwd_input=1.5, bwd_weight=0.5)
    assert res.step_ms == pytest.approx((m + pp - 1) * 3.0)
    assert res.rank_busy_ms == pytest.approx([m * 3.0] * pp)
    assert res.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs"])
@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 2), (2, 3, 6), (4, 2, 4), (4, 2, 6),
                                            (4, 3, 8), (4, 4, 12), (8, 2, 16)])
def test_interleaved_closed_form(schedule: str, pp: int, v: int, m: int) -> None:
    """m >= p, equal chunks: step = (m v + p - 1)(F + B) per chunk, bubble (p-1)/(m v + p - 1).

    Derived by hand from torch's orders and reproduced exactly by the simulator.
    """
    res = run(schedule, pp, v, m, fwd=1.0, bwd_input=0.5, bwd_weight=0.5)
    assert res.step_ms == pytest.approx((m * v + pp - 1) * 2.0)
    assert res.bubble_fraction == pytest.approx((pp - 1) / (m * v + pp - 1))


@pytest.mark.parametrize(("pp", "v", "m"), [(4, 2, 1), (4, 3, 2), (8, 2, 5), (8, 4, 7)])
def test_interleaved_few_microbatches(pp: int, v: int, m: int) -> None:
    """m < p (one partial round): torch's order gives step = (m + p v - 1)(F + B)."""
    res = run("interleaved-1f1b", pp, v, m, fwd=1.0, bwd_input=0.5, bwd_weight=0.5)
    assert res.step_ms == pytest.approx((m + pp * v - 1) * 2.0)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (2, 6), (4, 8), (4, 12), (4, 16)])
def test_zero_bubble_closed_forms(pp: int, m: int) -> None:
    """F = B = W = t, v = 2: ZB1P and ZBV idle only (p - 1) t, DualPipeV 2 (p - 1) t
    (its overlapped F+B sends leave after the whole pair, as torch runs it)."""
    work = 2 * m * 3 * 2.0
    assert run("interleaved-zb", pp, 2, m, fwd=2.0, bwd_input=2.0, bwd_weight=2.0
               ).step_ms == pytest.approx(work + (pp - 1) * 2.0)
    assert run("zbv", pp, 2, m, fwd=2.0, bwd_input=2.0, bwd_weight=2.0
               ).step_ms == pytest.approx(work + (pp - 1) * 2.0)
    assert run("dualpipev", pp, 2, m, fwd=2.0, bwd_input=2.0, bwd_weight=2.0
               ).step_ms == pytest.approx(work + 2 * (pp - 1) * 2.0)


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_zero_bubble_beats_1f1b(schedule: str) -> None:
    """Same model (a 1F1B stage = two chunks), equal F, B, W: a smaller bubble than 1F1B."""
    base = run("1f1b", 4, 1, 8, fwd=2.0, bwd_input=2.0, bwd_weight=2.0)
    zero = run(schedule, 4, 2, 8)
    assert zero.bubble_fraction < base.bubble_fraction
    assert zero.step_ms < base.step_ms


def test_gpipe_comm_on_the_critical_path() -> None:
    """Uncongested links: the first and last microbatch each cross p - 1 links both ways."""
    pp, m = 4, 8
    res = run("gpipe", pp, 1, m, fwd=1.0, bwd_input=0.7, bwd_weight=0.3, output_bytes=200_000)
    assert res.step_ms == pytest.approx((m + pp - 1) * 2.0 + 2 * (pp - 1) * 0.2)


def test_sends_serialize_per_link() -> None:
    """p = 2, m = 3, F = B = 1, 3 ms per send: traced by hand, the link is the bottleneck.

    Activations leave rank 0 at 1, 2, 3 and arrive 4, 7, 10; rank 1 runs F at 4, 7, 10,
    B at 11, 12, 13; gradients arrive 15, 18, 21; rank 0's last B ends at 22.
    """
    costs = [stage(1.0, 0.5, 0.5, output_bytes=3_000_000), stage(1.0, 0.5, 0.5)]
    res = simulate(costs, schedule="gpipe", pp_size=2, virtual_stages=1, num_microbatches=3,
                   setup=NO_LATENCY)
    assert res.step_ms == pytest.approx(22.0)
    sends = [(e.rank, e.start_ms, e.end_ms) for e in res.events if e.kind == "SEND"]
    assert sends == [(0, 1.0, 4.0), (0, 4.0, 7.0), (0, 7.0, 10.0),
                     (1, 12.0, 15.0), (1, 15.0, 18.0), (1, 18.0, 21.0)]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_turnaround_is_free(schedule: str) -> None:
    """pp = 1: both stages on one rank, so even a huge boundary costs nothing."""
    costs = [stage(output_bytes=10**12), stage()]
    res = simulate(costs, schedule=schedule, pp_size=1, virtual_stages=2, num_microbatches=3,
                   setup=NO_LATENCY)
    assert res.step_ms == pytest.approx(2 * 3 * 3.0)
    assert res.bubble_fraction == pytest.approx(0.0)


# --- in-flight counts and memory ----------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(2, 2), (4, 4), (4, 9), (8, 32)])
def test_max_in_flight_single_stage_schedules(pp: int, m: int) -> None:
    """1F1B: stage s holds min(p - s, m); GPipe: m everywhere."""
    assert max_in_flight("1f1b", pp, 1, m) == [min(pp - s, m) for s in range(pp)]
    assert max_in_flight("gpipe", pp, 1, m) == [m] * pp


def test_max_in_flight_multi_stage_schedules() -> None:
    """Counted from torch's orders (p = 4, v = 2, m = 8)."""
    assert max_in_flight("interleaved-1f1b", 4, 2, 8) == [8, 8, 7, 5, 4, 4, 3, 1]
    assert max_in_flight("looped-bfs", 4, 2, 8) == [8] * 8
    assert max_in_flight("zbv", 4, 2, 8) == [8, 7, 6, 5, 4, 3, 2, 1]
    assert max_in_flight("dualpipev", 4, 2, 8) == [8, 7, 6, 5, 4, 3, 2, 1]


def test_1f1b_waits_on_its_batched_sends() -> None:
    """pp 2, m 2, F 1 ms, B 1 ms, 1 ms per transfer, by hand.

    Rank 0: F0 [0,1] (send async), F1 [1,2], its send (batched with B0's receive) on
    the link [2,3], so rank 0 waits until 3. Rank 1: F0 [2,3], B0 [3,4], its send
    (batched with F1's receive) [4,5]: rank 1 waits, F1 [5,6], B1 [6,7], send [7,8]
    (cool-down, async). Rank 0: B0 [5,6], B1 [8,9]. Async sends would give 8.
    """
    costs = [stage(fwd=1.0, bwd_input=1.0, bwd_weight=0.0, output_bytes=1_000_000),
             stage(fwd=1.0, bwd_input=1.0, bwd_weight=0.0)]
    res = simulate(costs, schedule="1f1b", pp_size=2, virtual_stages=1, num_microbatches=2,
                   setup=NO_LATENCY)
    assert res.step_ms == 9.0
    starts = {(e.rank, e.kind, e.microbatch_idx): e.start_ms for e in res.events
              if e.kind != "SEND"}
    assert starts[(1, "F", 1)] == 5.0 and starts[(0, "B", 1)] == 8.0
    assert simulate_batch([costs], schedule="1f1b", pp_size=2, virtual_stages=1,
                          num_microbatches=2, setup=NO_LATENCY)[0].step_ms == 9.0
    gpipe = simulate(costs, schedule="gpipe", pp_size=2, virtual_stages=1,
                     num_microbatches=2, setup=NO_LATENCY)
    assert gpipe.step_ms < 9.0  # GPipe's sends stay asynchronous


def test_peak_memory_1f1b() -> None:
    """Rank r of 1F1B peaks at static + m receive buffers of input and output + (p - r)
    activations + its transient."""
    pp, m = 4, 8
    res = run("1f1b", pp, 1, m, output_bytes=50)
    assert res.rank_peak_memory_bytes == tuple(1000 + m * (7 + 50) + (pp - r) * 100 + 30
                                               for r in range(pp))
    assert res.stage_max_in_flight == (4, 3, 2, 1)


def test_peak_memory_sums_a_ranks_stages() -> None:
    """GPipe holds all m; a V rank sums both stages' static and buffers, and holds
    activations until W."""
    assert run("gpipe", 2, 1, 5).rank_peak_memory_bytes == (1000 + 5 * 7 + 5 * 100 + 30,) * 2
    costs = [stage(transient_bytes=30 * (s + 1)) for s in range(2)]
    res = simulate(costs, schedule="zbv", pp_size=1, virtual_stages=2, num_microbatches=3,
                   setup=NO_LATENCY)
    # order F0s0 F0s1 B0s1 W0s1 F1s0 ...: never more than two microbatches held at once,
    # the peak while stage 1 (workspace 60) runs with both held
    assert res.rank_peak_memory_bytes == (2 * 1000 + 2 * 3 * 7 + 2 * 100 + 60,)


def test_transient_counts_only_while_its_stage_runs() -> None:
    """ZBV on one rank, m = 1: F0s0 F0s1 B0s1 W0s1 B0s0 W0s0. Stage 0's workspace
    (300) runs with one microbatch held (100), stage 1's (0) with two: the peak is
    100 + 300 = 400, not the old 2 * 100 + 300."""
    costs = [stage(transient_bytes=300), stage(transient_bytes=0)]
    res = simulate(costs, schedule="zbv", pp_size=1, virtual_stages=2, num_microbatches=1,
                   setup=NO_LATENCY)
    assert res.rank_peak_memory_bytes == (2 * 1000 + 2 * 7 + 400,)


# --- orders -------------------------------------------------------------------------------------


def _grid():
    """(schedule, pp, v, m) over pp in {2, 4}, the v each schedule allows, m in {pp, 2pp, 3pp}."""
    for schedule, vs in [("gpipe", (1,)), ("1f1b", (1,)), ("interleaved-1f1b", (2, 3)),
                         ("looped-bfs", (2, 3)), ("interleaved-zb", (2, 3)), ("zbv", (2,)),
                         ("dualpipev", (2,))]:
        for pp in (2, 4):
            for v in vs:
                for m in (pp, 2 * pp, 3 * pp, 4 * pp):
                    if schedule == "dualpipev" and m < pp * v:
                        continue
                    yield schedule, pp, v, m


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), list(_grid()))
def test_orders_cover_every_action_once(schedule: str, pp: int, v: int, m: int) -> None:
    """Each (stage, mb) runs once per kind, on the rank stage_to_rank gives, and simulates."""
    info = schedule_info(schedule)
    kinds = ("F", "B", "W") if info.split_backward else ("F", "B")
    orders = rank_orders(schedule, pp, v, m)
    assert len(orders) == pp
    seen = sorted((a.kind, a.stage_idx, a.microbatch_idx) for row in orders for a in row)
    assert seen == sorted((k, s, mb) for k in kinds for s in range(pp * v) for mb in range(m))
    for rank, row in enumerate(orders):
        assert {stage_to_rank(a.stage_idx, pp, v, info.style) for a in row} == {rank}
    res = run(schedule, pp, v, m)
    assert sum(e.kind != "SEND" for e in res.events) == len(seen)


def test_1f1b_order_numbers_last_rank_from_zero() -> None:
    """The last rank alternates F0 B0 F1 B1 (torch 2.13's pipeline_order starts it at F1)."""
    last = rank_orders("1f1b", 4, 1, 4)[3]
    assert [(a.kind, a.microbatch_idx) for a in last][:4] == [("F", 0), ("B", 0), ("F", 1),
                                                              ("B", 1)]
    assert [(a.kind, a.microbatch_idx) for a in rank_orders("1f1b", 4, 1, 4)[0]][:5] == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]


def test_dualpipev_expands_overlapped_pairs() -> None:
    """An OVERLAP_F_B of torch becomes F then B then W of its backward stage."""
    row = [(a.kind, a.stage_idx, a.microbatch_idx) for a in rank_orders("dualpipev", 2, 2, 4)[0]]
    start = row.index(("F", 0, 3))
    assert row[start:start + 3] == [("F", 0, 3), ("B", 3, 1), ("W", 3, 1)]


def test_full_backwards_hold_nothing_for_their_w() -> None:
    """DualPipeV runs its overlapped phase's backwards whole (one torch action B W, as a
    live-tensor run shows), so they keep no gradients for a later W; ZBV's B and W are two
    actions. Rank 0 of pp 2, m 8: only the first B of stage 3 and the last two of stage 0
    are split."""
    from autopart.simulate._compiled_arrays import compiled_arrays
    from autopart.simulate.compiled import _full_backwards

    rows = compiled_arrays("dualpipev", 2, 2, 8)[0]
    full = [(int(s), int(mb)) for s, mb in rows[_full_backwards(rows)][:, 1:3]]
    assert sorted(full) == [(0, mb) for mb in range(6)] + [(3, mb) for mb in range(1, 8)]
    assert not any(_full_backwards(r).any() for r in compiled_arrays("zbv", 2, 2, 8))


# --- traces -------------------------------------------------------------------------------------


def test_chrome_trace_is_valid_json(tmp_path) -> None:
    """One X event on pid 0 per compute action, named like F3 s1, times in microseconds."""
    res = run("1f1b", 2, 1, 4, output_bytes=1000)
    trace = json.loads(json.dumps(chrome_trace(res, stage_names=["embed..l3", "l4..head"])))
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert len(compute) == 2 * 2 * 4
    first = min(compute, key=lambda e: (e["tid"], e["ts"]))
    assert (first["name"], first["tid"], first["ts"], first["dur"]) == ("F0 s0", 0, 0.0, 1000.0)
    assert first["args"]["stage_name"] == "embed..l3"
    path = tmp_path / "trace.json"
    write_trace(res, path)
    assert len(json.loads(path.read_text())["traceEvents"]) == len(trace["traceEvents"])


def test_render_timeline_exact() -> None:
    """1F1B p = 2, m = 2, F = B = 1 ms: traced by hand, one char per ms."""
    text = render_timeline(run("1f1b", 2, 1, 2, bwd_input=0.5, bwd_weight=0.5), width=6)
    assert text.splitlines()[1:] == ["r0 |FF.B.B|", "r1 |.FBFB.|"]


# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_raises_plan_error() -> None:
    """Wrong stage count, negative time, unknown schedule, settings torch rejects."""
    with pytest.raises(PlanError, match="expected pp_size"):
        simulate([stage()] * 3, schedule="1f1b", pp_size=2, virtual_stages=1,
                 num_microbatches=2, setup=NO_LATENCY)
    with pytest.raises(PlanError, match="negative"):
        simulate([stage(fwd=-1.0), stage()], schedule="1f1b", pp_size=2, virtual_stages=1,
                 num_microbatches=2, setup=NO_LATENCY)
    with pytest.raises(PlanError, match="unknown schedule"):
        rank_orders("2f2b", 2, 1, 2)
    with pytest.raises(PlanError, match="at least as many microbatches"):
        max_in_flight("1f1b", 4, 1, 3)
    with pytest.raises(PlanError, match="exactly 2"):
        rank_orders("zbv", 2, 3, 4)
    with pytest.raises(PlanError, match=">= 1"):
        rank_orders("gpipe", 2, 1, 0)


def test_bad_trace_arguments() -> None:
    """Stage names must match the stages; a timeline needs a positive width."""
    res = run("gpipe", 2, 1, 2)
    with pytest.raises(ValueError, match="stage names"):
        chrome_trace(res, stage_names=["only one"])
    with pytest.raises(ValueError, match="width"):
        render_timeline(res, width=0)


def test_deadlocked_order_is_an_internal_error() -> None:
    """A rank whose B precedes the F it needs never progresses: AssertionError, not a hang."""
    plan = ((compile_action("B", 0, 0, 0, [0], 1), compile_action("F", 0, 0, 0, [0], 1)),)
    with pytest.raises(AssertionError, match="deadlocked"):
        run_compiled(plan, ([1.0], [1.0], [0.0]), [[0.0], [0.0]], 1, 1, None)


def test_simulate_plan_replays_a_hand_written_plan():
    """1F1B on 2 ranks, 4 microbatches, equal stages F=1, B=2, nothing sent:
    (m + p - 1)(F + B) = 5 * 3 = 15 ms, the closed form above, from the plan alone."""
    from autopart.schema import Plan, RankPlan, StagePlan
    from autopart.simulate import simulate_plan

    stages = tuple(StagePlan(index=i, rank=i, modules=(f"b{i}",), fwd_ms=1.0, bwd_ms=2.0,
                             bwd_input_ms=2.0, bwd_weight_ms=0.0, param_count=0)
                   for i in range(2))
    ranks = tuple(RankPlan(rank=i, stages=(i,), peak_memory_bytes=0, busy_ms=0.0)
                  for i in range(2))
    plan = Plan(profile_fingerprint="f", pp_size=2, virtual_stages=1, schedule="1f1b",
                num_microbatches=4, pipeline_cuts=("b0",), stages=stages, ranks=ranks,
                predicted_step_ms=0.0, bubble_fraction=0.0,
                setup=TrainingSetup(pp_size=2, num_microbatches=4))
    result = simulate_plan(plan)
    assert result.step_ms == pytest.approx(15.0)
    assert result.rank_busy_ms == pytest.approx([12.0, 12.0])
    assert not simulate_plan(plan, record_events=False).events


def test_counting_pass_of_the_router_loss():
    """``counting_pass_ms``: 1F1B runs its order forward-only (pp 2, m 3, F 1 ms, sends
    1 ms, no backward: rank 0 runs F0 0-1, F1 1-2, waits for F1's send until 3 (1F1B
    batches it with the next receive), F2 3-4, sends it 4-5; rank 1's F2 runs 5-6); a
    split-backward schedule pays a whole step; ``with_step_overhead`` adds it only when
    the setup asks for it."""
    import dataclasses

    from autopart.simulate import with_step_overhead
    from autopart.simulate.replay import counting_pass_ms

    costs = [stage(fwd=1.0, bwd_input=2.0, bwd_weight=2.0, output_bytes=1_000_000),
             stage(fwd=1.0, bwd_input=2.0, bwd_weight=2.0, output_bytes=1_000_000)]
    setup = dataclasses.replace(NO_LATENCY, pp_size=2, num_microbatches=3)
    kw = {"pp_size": 2, "virtual_stages": 1, "num_microbatches": 3}
    assert counting_pass_ms(costs, schedule="1f1b", setup=setup, step_ms=99.0, **kw) == 6.0
    assert counting_pass_ms(costs, schedule="zbv", setup=setup, step_ms=99.0, pp_size=2,
                            virtual_stages=2, num_microbatches=3) == 99.0
    result = simulate(costs, schedule="1f1b", setup=setup, record_events=False, **kw)
    asked = dataclasses.replace(setup, router_loss_pass=True)
    assert with_step_overhead(result, setup, costs, "1f1b", 1, 3).step_ms == result.step_ms
    assert with_step_overhead(result, asked, costs, "1f1b", 1, 3).step_ms == \
        result.step_ms + 6.0

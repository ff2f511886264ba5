"""The machine check (runtime overhead) and how the cost model uses it.

Closed forms worked by hand: a stage's F and B grow by the per-action cost plus one
p2p op per neighbouring cut; a step grows by the per-step cost; the fit of the
check's raw timings splits the per-step rest into p2p ops and a constant.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from solve_helpers import llama_like, make_block, make_profile

from autopart.cost.blocks import block_arrays
from autopart.cost.rank import post_charges_ms
from autopart.cost.stage import stage_cost
from autopart.errors import SchemaError
from autopart.schema import Plan, Profile, RuntimeOverhead, TrainingSetup
from autopart.simulate import simulate_plan
from autopart.solve import make_plan
from autopart.verify import machine
from autopart.verify.machine_runtime import MIN_POST_MS

OVERHEAD = RuntimeOverhead(fwd_action_ms=0.5, bwd_action_ms=0.25, p2p_ms=0.125, step_ms=2.0,
                           link_latency_ms=0.05, link_bandwidth_bytes_per_s=2e9,
                           backend="gloo", num_threads=1)


def _three_blocks() -> Profile:
    return make_profile([make_block(f"b{i}", fwd_ms=1.0, bwd_ms=2.0, output_bytes=0)
                         for i in range(3)])


def test_stage_cost_adds_action_and_p2p_overhead():
    """Middle stage: 2 cuts -> F = 1 + 0.5 + 2 * 0.125, B = 1 + 0.25 + 2 * 0.125."""
    setup = TrainingSetup(pp_size=3, num_microbatches=1, runtime_overhead=OVERHEAD)
    arrays = block_arrays(_three_blocks(), setup)
    middle = stage_cost(arrays, 1, 1)
    assert middle.fwd_ms == pytest.approx(1.75)
    assert middle.bwd_input_ms == pytest.approx(1.5)
    assert middle.bwd_weight_ms == pytest.approx(1.0)
    first = stage_cost(arrays, 0, 0)
    assert first.fwd_ms == pytest.approx(1.625)
    whole = stage_cost(arrays, 0, 2)  # no cut: the action cost only
    assert whole.fwd_ms == pytest.approx(3.5)


def test_no_overhead_leaves_costs_alone():
    setup = TrainingSetup(pp_size=3, num_microbatches=1)
    assert stage_cost(block_arrays(_three_blocks(), setup), 1, 1).fwd_ms == pytest.approx(1.0)


def test_a_stage_pays_for_the_glue_to_its_end_and_the_stand_ins_before_it():
    """Glue 1.0 ms of which 0.1 / 0.2 / 0.3 after each block (0.4 before the first),
    stand-ins 0.01 / 0.02 / 0.04, a walk of 5 ms into block 2: each stage's F is its
    blocks + the glue from the model's start to its end + the stand-ins before it (+ the
    walk where it starts)."""
    base = _three_blocks()
    blocks = [dataclasses.replace(b, glue_after_ms=0.1 * (i + 1), stand_in_ms=0.01 * 2 ** i,
                                  walk_ms=5.0 if i == 2 else 0.0)
              for i, b in enumerate(base.blocks)]
    profile = dataclasses.replace(base, blocks=tuple(blocks),
                                  setup=dataclasses.replace(base.setup, glue_fwd_ms=1.0))
    arrays = block_arrays(profile, TrainingSetup(pp_size=3, num_microbatches=1))
    assert stage_cost(arrays, 0, 0).fwd_ms == pytest.approx(1.0 + 0.4 + 0.1)
    assert stage_cost(arrays, 1, 1).fwd_ms == pytest.approx(1.0 + 0.4 + 0.3 + 0.01)
    assert stage_cost(arrays, 2, 2).fwd_ms == pytest.approx(1.0 + 1.0 + 0.03 + 5.0)
    assert stage_cost(arrays, 0, 2).fwd_ms == pytest.approx(3.0 + 1.0)
    assert stage_cost(arrays, 1, 1).bwd_input_ms == pytest.approx(1.0)  # no glue in B


def test_plan_records_overhead_and_adds_step_cost():
    """GPipe, 1 microbatch, 3 stages of F=1.75.. : the step is the chain plus 2 ms."""
    profile = dataclasses.replace(_three_blocks(), runtime_overhead=OVERHEAD)
    plain = make_plan(_three_blocks(), pp_size=3, num_microbatches=1, schedule="gpipe",
                      virtual_stages=1, link_latency_ms=0.0, link_bandwidth_bytes_per_s=1e18)
    plan = make_plan(profile, pp_size=3, num_microbatches=1, schedule="gpipe",
                     virtual_stages=1, link_latency_ms=0.0, link_bandwidth_bytes_per_s=1e18)
    assert plan.setup.runtime_overhead == OVERHEAD
    # F: 1.625 + 1.75 + 1.625, B: 1.375 + 1.5 + 1.375 (+ the W halves: 3 x 1.0), + 2 ms
    extra = (0.625 + 0.75 + 0.625) + (0.375 + 0.5 + 0.375) + 2.0
    assert plan.predicted_step_ms == pytest.approx(plain.predicted_step_ms + extra)
    again = Plan.from_json(plan.to_json())
    assert again.setup.runtime_overhead == OVERHEAD
    assert simulate_plan(again).step_ms == pytest.approx(plan.predicted_step_ms)


def test_plan_takes_the_measured_link_unless_given():
    profile = dataclasses.replace(llama_like(4), runtime_overhead=OVERHEAD)
    plan = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b", virtual_stages=1)
    assert plan.setup.link_latency_ms == 0.05
    assert plan.setup.link_bandwidth_bytes_per_s == 2e9
    given = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b",
                      virtual_stages=1, link_latency_ms=0.5)
    assert given.setup.link_latency_ms == 0.5


def test_fit_splits_rest_into_p2p_and_step():
    """rest(m) = step + 2 m p2p: rest(2) = 3, rest(8) = 6 -> p2p = 0.25, step = 2."""
    rank = {"fwd": [0.3, 0.3], "bwd": [0.5, 0.5], "rest": {"2": [3.0], "8": [6.0]},
            "module_fwd": 0.1, "module_bwd": 0.2,
            "link": {"small_ms": 0.05, "large_ms": 2.05, "large_bytes": 4 * 2**20}}
    out = machine._fit([rank, rank], "gloo", 1, 0.5)
    assert out.fwd_action_ms == pytest.approx(0.2)
    assert out.bwd_action_ms == pytest.approx(0.3)
    assert out.p2p_ms == pytest.approx(0.25)
    assert out.step_ms == pytest.approx(2.0)
    assert out.link_bandwidth_bytes_per_s == pytest.approx(4 * 2**20 / 2e-3, rel=1e-3)
    assert out.link_latency_ms == pytest.approx(0.05)
    busy = {**rank, "link": {**rank["link"], "busy_small_ms": 0.6}}
    loaded = machine._fit([busy, busy], "gloo", 1, 0.5)
    assert loaded.link_latency_ms == pytest.approx(0.6)  # beside a busy core, as in a pipeline
    assert loaded.link_bandwidth_bytes_per_s == out.link_bandwidth_bytes_per_s


def test_fit_runtime_posts_and_all_reduce():
    """Rest 5 ms at 24 posts, 11 ms at 48 -> 0.25 ms per post; all-reduce 4 MiB in 4 ms,
    32 MiB in 25 ms -> 28 MiB per 21 ms, the 4 MiB taking 3 ms of it -> 1 ms fixed."""
    runtime = {"4": {"rest": [5.0], "posts": 24}, "8": {"rest": [11.0], "posts": 48}}
    rank = {"runtime": runtime, "allreduce": {"4": 4.0, "32": 25.0}}
    posts, latency, bandwidth = machine.fit_runtime([rank, rank])
    assert posts == pytest.approx(0.25)
    assert bandwidth == pytest.approx(28 * 2**20 / 21e-3)
    assert latency == pytest.approx(1.0)
    shrank = {"4": {"rest": [5.0], "posts": 24}, "8": {"rest": [4.8], "posts": 48}}  # noise
    assert machine.fit_runtime([{**rank, "runtime": shrank}] * 2)[0] == MIN_POST_MS > 0
    old = {"fwd": [0.3], "bwd": [0.5], "rest": {"2": [3.0], "8": [6.0]}, "module_fwd": 0.1,
           "module_bwd": 0.2, "link": {"small_ms": 0.05, "large_ms": 2.05,
                                       "large_bytes": 4 * 2**20}}
    assert machine._fit([old, old], "gloo", 1, 0.5).runtime_p2p_ms == 0.0  # not measured
    both = machine._fit([{**old, **rank}] * 2, "gloo", 1, 0.5)
    assert both.runtime_p2p_ms == pytest.approx(0.25)
    assert both.allreduce_latency_ms == pytest.approx(1.0)


RUNTIME = dataclasses.replace(OVERHEAD, runtime_p2p_ms=0.5)


def test_post_charges_follow_the_runtime_posts():
    """0.5 ms per post under the action runtime, 0.125 per cut already in the stage
    cost: interleaved (ranks 0 1 0 1) posts at every cut; ZBV (ranks 0 1 1 0) posts
    nothing between stages 1 and 2 (one rank); single-stage schedules charge nothing."""
    setup = TrainingSetup(pp_size=2, num_microbatches=4, runtime_overhead=RUNTIME)
    assert post_charges_ms(setup, "interleaved-1f1b", 2, 2) == pytest.approx(
        [0.375, 0.75, 0.75, 0.375])
    assert post_charges_ms(setup, "zbv", 2, 2) == pytest.approx([0.375, 0.25, 0.25, 0.375])
    assert post_charges_ms(setup, "1f1b", 2, 1) is None
    old = TrainingSetup(pp_size=2, num_microbatches=4, runtime_overhead=OVERHEAD)
    assert post_charges_ms(old, "interleaved-1f1b", 2, 2) is None


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_runtime_posts_lengthen_multi_stage_steps_only(schedule):
    """The same cuts predicted with and without the runtime's post price: a multi-stage
    step grows (by at most every post of the busiest rank), 1F1B's does not move, and
    the replayed plan (events) agrees with the planner's figure (levels)."""
    base = dataclasses.replace(llama_like(8), runtime_overhead=OVERHEAD)
    priced = dataclasses.replace(base, runtime_overhead=RUNTIME)
    plain = make_plan(base, pp_size=2, num_microbatches=4, schedule=schedule,
                      virtual_stages=2)
    plan = make_plan(priced, pp_size=2, num_microbatches=4, schedule=schedule,
                     virtual_stages=2, cuts=tuple(plain.pipeline_cuts))
    assert plain.predicted_step_ms < plan.predicted_step_ms <= plain.predicted_step_ms + 24 * 0.5
    assert simulate_plan(plan).step_ms == pytest.approx(plan.predicted_step_ms)
    one = make_plan(base, pp_size=2, num_microbatches=4, schedule="1f1b", virtual_stages=1)
    again = make_plan(priced, pp_size=2, num_microbatches=4, schedule="1f1b",
                      virtual_stages=1, cuts=tuple(one.pipeline_cuts))
    assert again.predicted_step_ms == pytest.approx(one.predicted_step_ms)


def test_cache_round_trip(tmp_path):
    path = machine.save_cached_overhead(OVERHEAD, root=tmp_path)
    assert path.name.endswith(f"-gloo-1t-v{machine.CHECK_VERSION}.json")
    assert machine.load_cached_overhead("gloo", 1, root=tmp_path) == OVERHEAD
    assert machine.load_cached_overhead("gloo", 2, root=tmp_path) is None
    profile = _three_blocks()
    assert machine.machine_check_for(
        dataclasses.replace(profile, setup=dataclasses.replace(profile.setup, num_threads=1)),
        root=tmp_path) == OVERHEAD


def test_broken_cache_is_one_line(tmp_path):
    path = machine.cache_path("gloo", 1, root=tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fwd_action_ms": -1}))
    with pytest.raises(SchemaError, match="delete it"):
        machine.load_cached_overhead("gloo", 1, root=tmp_path)


def test_negative_overhead_refused():
    with pytest.raises(SchemaError, match="calibrate --machine"):
        dataclasses.replace(OVERHEAD, p2p_ms=-0.1)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_check_machine_runs_for_real():
    """Two gloo ranks with empty stages: every constant is measured and small."""
    out = machine.check_machine(num_threads=1, num_steps=4, num_warmup=1)
    assert out.backend == "gloo" and out.num_threads == 1
    assert 0 <= out.fwd_action_ms < 50 and 0 <= out.bwd_action_ms < 50
    assert out.link_bandwidth_bytes_per_s > 0 and out.link_latency_ms > 0
    assert 0 < out.runtime_p2p_ms < 50  # the action runtime's posts, stages computing
    assert out.allreduce_bandwidth_bytes_per_s > 0 and out.allreduce_latency_ms >= 0


def test_every_stage_forward_carries_the_model_glue():
    """glue 0.3 ms: each stage's F grows by it (with the check's 0.5 + p2p on top)."""
    base = _three_blocks()
    profile = dataclasses.replace(base, setup=dataclasses.replace(base.setup, glue_fwd_ms=0.3))
    plain = block_arrays(profile, TrainingSetup(pp_size=3, num_microbatches=1))
    assert stage_cost(plain, 0, 0).fwd_ms == pytest.approx(1.3)
    assert stage_cost(plain, 1, 2).fwd_ms == pytest.approx(2.3)
    assert stage_cost(plain, 1, 2).bwd_input_ms == pytest.approx(2.0)  # no glue in B
    checked = block_arrays(profile, TrainingSetup(pp_size=3, num_microbatches=1,
                                                  runtime_overhead=OVERHEAD))
    assert stage_cost(checked, 1, 1).fwd_ms == pytest.approx(1.0 + 0.3 + 0.5 + 0.25)

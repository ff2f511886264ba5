"""What torch's split backward adds (``split_extra_ms``) reaches zero-bubble W only.

Blocks of F 1, B 1, W 1 ms, each with 0.5 ms of split extra, worked by hand: a
stage's extra is its blocks' sum, except on the first stage (torch runs its whole
backward as W, not split); a split schedule's W carries it, a full backward does not.
"""

from __future__ import annotations

import dataclasses

import pytest
from solve_helpers import make_block, make_profile

from autopart.cost.blocks import block_arrays
from autopart.cost.stage import stage_cost
from autopart.levels import fuse
from autopart.schema import Plan, TrainingSetup
from autopart.simulate import simulate_plan
from autopart.solve import make_plan


def _profile(count: int = 3):
    blocks = [dataclasses.replace(make_block(f"b{i}", fwd_ms=1.0, bwd_ms=2.0),
                                  split_extra_ms=0.5) for i in range(count)]
    return make_profile(blocks)


def test_a_stage_sums_its_blocks_extra_except_the_first():
    arrays = block_arrays(_profile(), TrainingSetup(pp_size=2, num_microbatches=2))
    assert stage_cost(arrays, 1, 2).split_extra_ms == pytest.approx(1.0)
    assert stage_cost(arrays, 0, 1).split_extra_ms == 0.0  # whole backward as W
    assert fuse(_profile().blocks[1:]).split_extra_ms == pytest.approx(1.0)


def test_only_split_schedules_pay_it_and_plans_keep_it():
    profile = _profile(5)
    plain = dataclasses.replace(profile, blocks=tuple(
        dataclasses.replace(b, split_extra_ms=0.0) for b in profile.blocks))
    kwargs = {"pp_size": 2, "num_microbatches": 4, "cuts": ("b0",)}
    for schedule, grows in (("1f1b", False), ("gpipe", False)):
        with_extra = make_plan(profile, schedule=schedule, virtual_stages=1, **kwargs)
        without = make_plan(plain, schedule=schedule, virtual_stages=1, **kwargs)
        assert (with_extra.predicted_step_ms > without.predicted_step_ms) == grows
    zb = make_plan(profile, schedule="zbv", virtual_stages=2, pp_size=2, num_microbatches=4)
    zb0 = make_plan(plain, schedule="zbv", virtual_stages=2, pp_size=2, num_microbatches=4,
                    cuts=tuple(zb.pipeline_cuts))
    assert zb.predicted_step_ms > zb0.predicted_step_ms
    again = Plan.from_json(zb.to_json())
    assert [s.split_extra_ms for s in again.stages] == [s.split_extra_ms for s in zb.stages]
    assert sum(s.split_extra_ms for s in again.stages) > 0
    assert simulate_plan(again).step_ms == pytest.approx(zb.predicted_step_ms)

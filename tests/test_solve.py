"""Solver tests: exact small answers first, then baselines, plans, and bad input.

Exact answers are worked out by hand (torchgpipe's ``balance`` tests style); the
random comparisons against brute force live in ``test_solve_props.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from solve_helpers import GIB, MIB, brute_force, chain_of, llama_like, make_block, make_profile

from autopart.errors import InfeasibleError, PlanError
from autopart.schema import Plan
from autopart.solve import ILPLimits, baseline_split, make_plan, plan_again, solve_dp, solve_ilp
from autopart.solve.dp import min_fitting_limit


def _timed_chain(times, **block_fields):
    """Blocks whose F+B+W is ``times[b]`` (B = 2F), no comm, no memory."""
    blocks = [make_block(f"b{b}", fwd_ms=t / 3, **block_fields) for b, t in enumerate(times)]
    return chain_of(make_profile(blocks))


def _dp(chain, num_stages, weight, in_flight=None, limit=None, **kw):
    in_flight = in_flight or [1] * num_stages
    return solve_dp(chain, num_stages=num_stages, in_flight=in_flight,
                    limits_bytes=[limit] * num_stages, weight=weight, **kw)


def test_dp_torchgpipe_example():
    """[1..6] into 2 stages: the bottleneck 11 of [1,2,3,4 | 5,6] is the smallest."""
    sol = _dp(_timed_chain([1, 2, 3, 4, 5, 6]), 2, weight=1)
    assert sol.bounds == ((0, 4), (4, 6))
    assert sol.bottleneck_ms == pytest.approx(11)
    assert sol.objective_ms == pytest.approx(11 + 21)


def test_dp_uniform_blocks_split_evenly():
    sol = _dp(_timed_chain([1] * 6), 3, weight=7)
    assert sol.bounds == ((0, 2), (2, 4), (4, 6))
    assert sol.recompute == (False, False, False)


def test_dp_one_block_per_stage():
    sol = _dp(_timed_chain([5, 1, 1]), 3, weight=3)
    assert sol.bounds == ((0, 1), (1, 2), (2, 3))


def test_dp_comm_moves_the_cut_off_a_fat_boundary():
    """The balanced cut (after block 1) costs 20 ms of transfer; 3 | 9 costs none."""
    blocks = [make_block("a", fwd_ms=1), make_block("b", fwd_ms=1, output_bytes=10**9),
              make_block("c", fwd_ms=1), make_block("d", fwd_ms=1)]
    sol = _dp(chain_of(make_profile(blocks)), 2, weight=1)
    assert sol.bounds[0][1] != 2
    assert sol.objective_ms == pytest.approx(9 + 12)


def test_dp_memory_gives_the_first_stage_fewer_blocks():
    """Stage 0 holds 4 microbatches, stage 1 holds 1: 100 bytes fit 2 blocks on stage 0."""
    chain = _timed_chain([1] * 6, activation_bytes=10)
    assert _dp(chain, 2, weight=3).bounds == ((0, 3), (3, 6))
    sol = _dp(chain, 2, weight=3, in_flight=[4, 1], limit=100, allow_recompute=False)
    assert sol.bounds == ((0, 2), (2, 6))


def test_dp_recomputes_only_when_nothing_else_fits():
    chain = _timed_chain([1] * 4, activation_bytes=10)
    sol = _dp(chain, 2, weight=3, in_flight=[4, 4], limit=80)
    assert sol.recompute == (False, False)
    sol = _dp(chain, 2, weight=3, in_flight=[4, 4], limit=50)
    assert True in sol.recompute
    assert sol.objective_ms == pytest.approx(brute_force(chain, 2, [4, 4], [50, 50], 3))


def test_dp_reports_infeasible_and_the_limit_that_fits():
    chain = _timed_chain([1] * 4, activation_bytes=10)
    assert _dp(chain, 2, weight=1, in_flight=[4, 4], limit=30, allow_recompute=False) is None
    need = min_fitting_limit(chain, in_flight=[4, 4], allow_recompute=False,
                             resolution_bytes=1)
    assert need == 80
    assert _dp(chain, 2, weight=1, in_flight=[4, 4], limit=need, allow_recompute=False)


def test_dp_rejects_more_stages_than_blocks():
    with pytest.raises(ValueError, match="num_stages"):
        _dp(_timed_chain([1, 1]), 3, weight=1)


def test_ilp_matches_dp_with_one_stage_per_rank():
    chain = _timed_chain([3, 1, 4, 1, 5, 9, 2, 6])
    dp = _dp(chain, 3, weight=5)
    ilp = solve_ilp(chain, stage_ranks=[0, 1, 2], in_flight=[1, 1, 1], num_microbatches=6,
                    limits=ILPLimits(backend="cbc"))
    assert ilp.status == "optimal"
    assert ilp.objective_ms == pytest.approx(dp.objective_ms)


def test_ilp_balances_rank_sums_of_v_placement():
    """V placement puts stages 0 and 3 on rank 0: heavy ends pair with light middles."""
    chain = _timed_chain([6, 1, 1, 6])
    ilp = solve_ilp(chain, stage_ranks=[0, 1, 1, 0], in_flight=[1] * 4, num_microbatches=4,
                    limits=ILPLimits(backend="highs"))
    assert ilp.bounds == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert ilp.status == "optimal" and ilp.gap == 0.0


def test_solve_does_not_import_pulp_at_top_level():
    code = "import sys, autopart.solve; print('pulp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_baselines_on_a_llama_chain():
    blocks = llama_like(8).blocks  # embedding, 8 layers, norm, head = 11 blocks
    assert baseline_split("even", blocks, 4) == [(0, 3), (3, 5), (5, 7), (7, 11)]
    assert baseline_split("torchtitan", blocks, 4) == [(0, 3), (3, 6), (6, 8), (8, 11)]
    assert baseline_split("even", blocks, 3) == [(0, 4), (4, 7), (7, 11)]


def test_baselines_on_plain_blocks():
    blocks = [make_block(f"b{i}", num_params=w) for i, w in enumerate([5, 1, 1, 1, 9, 1, 1])]
    assert baseline_split("even", blocks, 3) == [(0, 3), (3, 5), (5, 7)]
    assert baseline_split("params", blocks, 3) == [(0, 4), (4, 5), (5, 7)]


def test_unknown_baseline_names_the_choices():
    with pytest.raises(ValueError, match="unknown baseline 'random'; choose one of even, params"):
        baseline_split("random", llama_like(2).blocks, 2)


def _covers_every_block_once(plan: Plan, num_blocks: int) -> None:
    nxt = 0
    for stage in plan.stages:
        assert stage.modules, stage
        assert stage.first_block_idx == nxt
        assert stage.last_block_idx - stage.first_block_idx + 1 == len(stage.modules)
        nxt = stage.last_block_idx + 1
    assert nxt == num_blocks
    assert len(plan.pipeline_cuts) == plan.pp_size * plan.virtual_stages - 1
    assert list(plan.pipeline_cuts) == [s.modules[-1] for s in plan.stages[:-1]]


def test_make_plan_fills_the_contract_and_beats_even():
    profile = llama_like(16)
    plan = make_plan(profile, pp_size=4, num_microbatches=8, schedule="1f1b")
    _covers_every_block_once(plan, len(profile.blocks))
    assert plan.schedule == "1f1b" and plan.virtual_stages == 1
    assert [r.stages for r in plan.ranks] == [(0,), (1,), (2,), (3,)]
    assert set(plan.baselines) == {"even", "params", "torchtitan"}
    for entry in plan.baselines.values():
        assert entry.speedup >= 1.0 - 1e-9
    assert plan.baselines["even"].speedup > 1.05  # the 3 ms head makes even slow
    assert plan.solver is not None and plan.solver.status in ("model_optimal", "baseline")


def test_make_plan_is_deterministic_and_round_trips():
    profile = llama_like(12)
    first = make_plan(profile, pp_size=2, num_microbatches=4)
    second = make_plan(profile, pp_size=2, num_microbatches=4)
    assert first.to_json() == second.to_json()
    assert Plan.from_json(first.to_json()).to_json() == first.to_json()


def test_make_plan_searches_schedules_and_virtual_stages():
    profile = llama_like(14)
    plan = make_plan(profile, pp_size=2, num_microbatches=8, solver="dp")
    _covers_every_block_once(plan, len(profile.blocks))
    fixed = make_plan(profile, pp_size=2, num_microbatches=8, schedule="1f1b")
    assert plan.predicted_step_ms <= fixed.predicted_step_ms + 1e-9


def test_make_plan_global_batch_size_picks_a_divisor():
    plan = make_plan(llama_like(6), pp_size=2, global_batch_size=8, schedule="1f1b")
    assert 8 % plan.num_microbatches == 0 and plan.num_microbatches >= 4



def test_make_plan_reports_progress_per_configuration():
    """1F1B, pp 2, batch 4: m is 2 or 4 (divisors >= pp), then the local search step."""
    calls = []
    make_plan(llama_like(4), pp_size=2, global_batch_size=4, schedule="1f1b",
              progress=lambda *update: calls.append(update))
    assert calls == [(1, 3, "1f1b v=1 m=2"), (2, 3, "1f1b v=1 m=4"), (3, 3, "local search")]

def test_memory_limit_gives_rank0_fewer_layers_and_says_why():
    """Under 1F1B rank 0 holds 4 microbatches, rank 3 one: even puts 2 layers on each."""
    profile = llama_like(8, act_bytes=GIB, head_act_bytes=GIB // 4)
    limit = 7 * GIB
    plan = make_plan(profile, pp_size=4, num_microbatches=8, schedule="1f1b",
                     memory_limit_bytes=limit, allow_recompute=False)
    assert not plan.baselines["even"].fits
    assert all(r.peak_memory_bytes <= limit for r in plan.ranks)
    layers0 = sum(m.startswith("model.layers.") for m in plan.stages[0].modules)
    assert layers0 < 2
    assert any(n.startswith("rank 0 holds 4 microbatches of activations under 1f1b "
                            "(rank 3 holds 1): it gets") for n in plan.notes), plan.notes


def test_pp_larger_than_blocks_names_both_numbers():
    with pytest.raises(PlanError, match=r"pp_size \(20\) exceeds the number of blocks of .* "
                       r"\(11: layer, head whole\); lower --pp to at most 11"):
        make_plan(llama_like(8), pp_size=20, num_microbatches=20)


def test_bad_settings_raise_plan_error():
    with pytest.raises(PlanError, match="unknown partition"):
        make_plan(llama_like(4), pp_size=2, partition="random")
    with pytest.raises(PlanError, match="needs at least as many microbatches"):
        make_plan(llama_like(4), pp_size=4, num_microbatches=2, schedule="1f1b")


def test_infeasible_names_the_memory_that_fits():
    profile = llama_like(8, act_bytes=GIB, head_act_bytes=GIB // 4)
    with pytest.raises(InfeasibleError) as info:
        make_plan(profile, pp_size=4, num_microbatches=8, schedule="1f1b",
                  memory_limit_bytes=GIB, allow_recompute=False)
    need = int(str(info.value).split("smallest limit that fits is ")[1].split(" bytes")[0])
    plan = make_plan(profile, pp_size=4, num_microbatches=8, schedule="1f1b",
                     memory_limit_bytes=need, allow_recompute=False)
    assert all(r.peak_memory_bytes <= need for r in plan.ranks)


@pytest.mark.parametrize(("schedule", "virtual"), [("zbv", 2), ("1f1b", 1),
                                                   ("interleaved-1f1b", 2)])
def test_the_reported_smallest_limit_plans(schedule, virtual):
    """Planning at the limit the error names succeeds, recompute allowed (ZBV never
    recomputes, so its limit must be the one without recomputation)."""
    profile = llama_like(8, act_bytes=GIB, head_act_bytes=GIB // 4)
    kwargs = {"pp_size": 2, "num_microbatches": 4, "schedule": schedule,
              "virtual_stages": virtual}
    with pytest.raises(InfeasibleError) as info:
        make_plan(profile, memory_limit_bytes=100 * MIB, **kwargs)
    need = int(str(info.value).split("smallest limit that fits is ")[1].split(" bytes")[0])
    plan = make_plan(profile, memory_limit_bytes=need, **kwargs)
    assert all(r.peak_memory_bytes <= need for r in plan.ranks)


def test_the_reported_smallest_limit_plans_with_b_to_w_gradients():
    """Under ZBV the layers hold 4 GiB of gradients each from B to W: the limit the
    error names counts them, so planning at it succeeds."""
    import dataclasses

    profile = llama_like(8, act_bytes=GIB, head_act_bytes=GIB // 4)
    blocks = tuple(dataclasses.replace(b, held_for_weight_bytes=4 * GIB)
                   if b.kind == "decoder_layer" else b for b in profile.blocks)
    profile = dataclasses.replace(profile, blocks=blocks)
    kwargs = {"pp_size": 2, "num_microbatches": 4, "schedule": "zbv", "virtual_stages": 2}
    with pytest.raises(InfeasibleError) as info:
        make_plan(profile, memory_limit_bytes=100 * MIB, **kwargs)
    need = int(str(info.value).split("smallest limit that fits is ")[1].split(" bytes")[0])
    plan = make_plan(profile, memory_limit_bytes=need, **kwargs)
    assert all(r.peak_memory_bytes <= need for r in plan.ranks)


def test_plan_again_keeps_the_split_and_setup_and_takes_the_new_costs():
    """A profile whose head costs four times as much: ``plan_again`` keeps the cuts,
    schedule, v, m, replicas, optimizer and memory limit, and prices them anew, where
    planning from scratch would move the cut."""
    asked = {"pp_size": 2, "num_microbatches": 4, "schedule": "1f1b", "dp_size": 2,
             "optimizer": "sgd", "memory_limit_bytes": 64 * GIB}
    plan = make_plan(llama_like(8), **asked)
    slower = llama_like(8, head_ms=12.0)
    again = plan_again(slower, plan)

    def kept(p: Plan) -> tuple:
        return (p.pipeline_cuts, p.schedule, p.virtual_stages, p.num_microbatches, p.dp_size,
                p.setup.optimizer, p.setup.memory_limit_bytes, p.granularity)

    assert kept(again) == kept(plan)
    assert again.predicted_step_ms > plan.predicted_step_ms
    assert make_plan(slower, **asked).pipeline_cuts != plan.pipeline_cuts
    with pytest.raises(PlanError, match="--devices"):
        plan_again(slower, dataclasses.replace(plan, tp_size=2))

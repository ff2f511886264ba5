"""Local search and cut restrictions: plans never lose to a baseline; NxD cuts stay on layers.

Compared against the baselines simulated in the same plan and hand-fused blocks.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solve_helpers import llama_like, make_block, make_profile

from autopart.errors import PlanError
from autopart.solve import make_plan, refine, search
from autopart.solve.refine import allowed_cuts, fuse_blocks, legal, neighbours
from autopart.solve.setting import ConfigJudge


def test_fuse_blocks_merges_runs_without_cuts():
    profile = llama_like(4)
    allowed = allowed_cuts(profile, ("decoder_layer",))
    kinds = [b.kind for b in profile.blocks]
    assert kinds[0] == "embedding" and kinds[-1] == "head"
    fused, starts = fuse_blocks(profile, allowed)
    # embedding + layer 0 fuse, and norm + head fuse; every decoder layer ends a run.
    assert starts == [0, 2, 3, 4, 5, len(profile.blocks)]
    first_two_ms = profile.blocks[0].fwd_ms + profile.blocks[1].fwd_ms
    assert fused.blocks[0].fwd_ms == pytest.approx(first_two_ms)
    assert fused.blocks[-1].output_bytes == profile.blocks[-1].output_bytes
    assert legal(((0, 2), (2, len(profile.blocks))), allowed)
    assert not legal(((0, 1), (1, len(profile.blocks))), allowed)


def test_no_restriction_is_identity():
    profile = llama_like(3)
    fused, starts = fuse_blocks(profile, allowed_cuts(profile, None))
    assert fused is profile and starts == list(range(len(profile.blocks) + 1))


def test_nxd_cuts_only_after_decoder_layers():
    profile = llama_like(8, head_ms=6.0)
    plan = make_plan(profile, pp_size=4, schedule="1f1b", num_microbatches=8,
                     cut_kinds=("decoder_layer",))
    kinds = {b.name: b.kind for b in profile.blocks}
    assert all(kinds[cut] == "decoder_layer" for cut in plan.pipeline_cuts)
    free = make_plan(profile, pp_size=4, schedule="1f1b", num_microbatches=8)
    assert free.predicted_step_ms <= plan.predicted_step_ms + 1e-9


def test_too_few_cut_positions_is_a_plan_error():
    profile = llama_like(2)
    with pytest.raises(PlanError, match="fewer than pp_size"):
        make_plan(profile, pp_size=4, num_microbatches=8, cut_kinds=("decoder_layer",))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(times=st.lists(st.floats(0.1, 10.0), min_size=4, max_size=10),
       pp=st.integers(2, 3), schedule=st.sampled_from(["1f1b", "gpipe"]))
def test_plan_never_slower_than_a_fitting_baseline(times, pp, schedule):
    blocks = [make_block(f"b{i}", fwd_ms=t, output_bytes=1 << 20, activation_bytes=1 << 22)
              for i, t in enumerate(times)]
    plan = make_plan(make_profile(blocks), pp_size=pp, schedule=schedule,
                     num_microbatches=2 * pp)
    for base in plan.baselines.values():
        if base.fits:
            assert plan.predicted_step_ms <= base.predicted_step_ms * (1 + 1e-9)


def test_neighbours_move_one_or_two_cuts_to_allowed_positions():
    """Hand-listed: three stages over 6 blocks, cuts at 2 and 4, cut 3 forbidden."""
    allowed = [True, True, True, False, True, True, True]
    bounds = ((0, 2), (2, 4), (4, 6))
    moves = [b for b, _ in neighbours(bounds, (False, False, False), allowed)]
    cuts = [tuple(j for _, j in b[:-1]) for b in moves]
    # single moves: 2 -> 1, (2 -> 3 forbidden, skips to 4: stage empty), 4 -> 5 (4 -> 3 -> 2 empty)
    assert cuts[:2] == [(1, 4), (2, 5)]
    # pairs (both left, both right, apart, together): (1, 2)  (4, 5)  (1, 5)  (4, 2) invalid;
    # both right is legal because 4 leaves for 5 while 2 skips the forbidden 3
    assert cuts[2:] == [(1, 2), (4, 5), (1, 5)]
    assert all(legal(b, allowed) for b in moves)


def test_recompute_drops_come_first():
    moves = list(neighbours(((0, 1), (1, 3)), (True, False), [True] * 4))
    assert moves[0] == (((0, 1), (1, 3)), (False, False))



def _profile48():
    return make_profile([make_block(f"b{i}", fwd_ms=1.0 + (i % 7) * 0.37, output_bytes=1 << 20)
                         for i in range(48)])


def _count_simulations(monkeypatch) -> tuple[int, int, int, object]:
    """In one ``make_plan`` (one configuration): the simulations the local search counts,
    the nodes of the configuration's step DAG, the splits it simulated in all, the plan."""
    counted, nodes, simulated = [], set(), []
    original_refine, original_many = search.refine_counted, ConfigJudge.evaluate_many

    def refine_counted(judge, *args, **kwargs):
        nodes.add(judge.num_nodes)
        best, spent = original_refine(judge, *args, **kwargs)
        counted.append(spent)
        return best, spent

    def evaluate_many(self, splits):
        simulated.extend(splits)
        return original_many(self, splits)

    monkeypatch.setattr(search, "refine_counted", refine_counted)
    monkeypatch.setattr(ConfigJudge, "evaluate_many", evaluate_many)
    plan = make_plan(_profile48(), pp_size=6, num_microbatches=12, schedule="1f1b")
    return sum(counted), nodes.pop(), len(simulated), plan


def test_local_search_stops_at_its_node_budget(monkeypatch):
    """The seeds' climbs together count at most ``_REFINE_NODE_BUDGET`` DAG nodes."""
    unbounded, nodes, _, _ = _count_simulations(monkeypatch)
    assert unbounded > 12  # the four seeds' climbs need more than the budget below
    monkeypatch.setattr(search, "_REFINE_NODE_BUDGET", 12 * nodes)
    assert _count_simulations(monkeypatch)[0] == 12


def test_batched_climb_is_the_one_move_at_a_time_climb(monkeypatch):
    """Moves simulated in batches (``refine._WIDEST_BATCH``) give the climb and the count
    of simulating them one at a time; only the batches' vain tails are extra work."""
    batched, _, simulated, plan = _count_simulations(monkeypatch)
    monkeypatch.setattr(refine, "_WIDEST_BATCH", 1)
    single, _, simulated_single, alone = _count_simulations(monkeypatch)
    assert batched == single == simulated_single
    assert simulated > batched  # the batches did simulate moves past a kept one
    assert plan.pipeline_cuts == alone.pipeline_cuts
    assert plan.predicted_step_ms == alone.predicted_step_ms


def test_the_router_loss_pass_is_priced_and_steers_the_schedule():
    """A profile whose config asks for the MoE router loss: every plan's step holds the
    counting pass, a whole extra step under a split-backward schedule (ZBV exactly twice
    its step without), so between 1F1B and ZBV the search leaves the one that pays double."""
    import dataclasses

    plain = make_profile([make_block(f"b{i}", fwd_ms=1.0 + (i % 3) * 0.5,
                                     output_bytes=1 << 20) for i in range(12)])
    asked = dataclasses.replace(plain, model=dataclasses.replace(plain.model,
                                                                 router_loss_pass=True))
    kw = {"pp_size": 2, "num_microbatches": 4}
    zbv = make_plan(plain, schedule="zbv", **kw)
    assert make_plan(asked, schedule="zbv", cuts=list(zbv.pipeline_cuts),
                     **kw).predicted_step_ms == pytest.approx(2 * zbv.predicted_step_ms,
                                                              rel=1e-12)
    one = make_plan(plain, schedule="1f1b", **kw)
    priced = make_plan(asked, schedule="1f1b", cuts=list(one.pipeline_cuts), **kw)
    assert one.predicted_step_ms < priced.predicted_step_ms < 2 * one.predicted_step_ms
    assert priced.setup.router_loss_pass
    assert any("router loss" in note for note in priced.notes)
    assert make_plan(plain, schedule=("1f1b", "zbv"), **kw).schedule == "zbv"
    assert make_plan(asked, schedule=("1f1b", "zbv"), **kw).schedule == "1f1b"

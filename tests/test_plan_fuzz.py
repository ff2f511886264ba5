"""The plan fuzz (``plan_fuzz``): seeded random shapes of the served families x random
``autopart plan`` options end in a plan or one refusal line, and sampled plans train
exactly (loss and every gradient against the unpipelined model, 2 or 4 gloo ranks).

``scripts/plan_fuzz.py --cases 200`` runs the same with any seed and size.
"""

from __future__ import annotations

import pytest
from plan_fuzz import cases, run_plan, train_worker, trainable
from runtime_helpers import check_exact, run_ranks

pytestmark = pytest.mark.slow

SEED, NUM_CASES, NUM_TRAINED = 20261124, 30, 2


@pytest.mark.timeout(900)
def test_seeded_plans_end_in_a_plan_or_one_line(tmp_path):
    outcomes = [run_plan(case, path, tmp_path) for case, path in
                cases(SEED, NUM_CASES, tmp_path)]
    failed = [f"{o.case.family} {' '.join(o.case.argv)}: {o.message}" for o in outcomes
              if o.result == "failed"]
    assert not failed, "\n".join(failed)
    assert sum(o.result == "plan" for o in outcomes) >= NUM_CASES // 3  # not only refusals


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_sampled_plans_train_exactly(tmp_path):
    trained = 0
    for case, path in cases(SEED, NUM_CASES, tmp_path):
        outcome = run_plan(case, path, tmp_path)
        if not trainable(outcome):
            continue
        from autopart.schema import Plan

        world = Plan.load(outcome.plan_path).pp_size
        (tmp_path / f"run{case.index}").mkdir()
        results = run_ranks(train_worker, world, tmp_path / f"run{case.index}", case,
                            str(outcome.plan_path))
        check_exact(results, {"plan": None}, 1e-5)
        trained += 1
        if trained == NUM_TRAINED:
            break
    assert trained == NUM_TRAINED

"""ILP tests: runs of identical blocks, the rank-time floor, and the benchmark case.

The property test compares against ``solve_helpers.brute_force_ranks`` (every split
and recompute choice, exact rank sums) on chains drawn from a small palette of
blocks, so that runs of identical blocks, which the model aggregates, are common.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solve_helpers import (
    GIB,
    brute_force_ranks,
    chain_of,
    check_ilp_against_brute_force,
    llama_like,
    make_block,
    make_profile,
    rank_memory,
)

from autopart.schedules import stage_to_rank
from autopart.schema import TrainingSetup
from autopart.solve import ILPLimits, solve_ilp
from autopart.solve._ilp_model import block_runs, rank_time_floor
from autopart.solve.ilp import rank_objective

_BENCH_IN_FLIGHT = [16, 16, 16, 16, 15, 13, 11, 9, 8, 8, 8, 8, 7, 5, 3, 1]
"""``max_in_flight("interleaved-1f1b", 8, 2, 16)``, spelled out: the simulator takes seconds."""

_PALETTE = [{"fwd_ms": 1.0, "num_params": 10, "activation_bytes": 100, "output_bytes": 10},
            {"fwd_ms": 1.0, "num_params": 10, "activation_bytes": 100, "output_bytes": 30,
             "transient_bytes": 20},
            {"fwd_ms": 2.0, "num_params": 30, "activation_bytes": 40, "output_bytes": 10},
            {"fwd_ms": 0.5, "num_params": 0, "activation_bytes": 0, "output_bytes": 0}]


def _chain(kinds):
    blocks = [make_block(f"b{i}", **_PALETTE[k]) for i, k in enumerate(kinds)]
    return chain_of(make_profile(blocks))


def test_runs_group_identical_decoder_layers():
    runs = block_runs(chain_of(llama_like(5)))
    assert [(r.start, r.size) for r in runs] == [(0, 1), (1, 5), (6, 1), (7, 1)]


def test_floor_knows_blocks_are_indivisible():
    """Five 3 ms blocks on two ranks: one rank takes three of them (9 ms), not 7.5."""
    runs = block_runs(_chain([3] * 5))  # 0.5 ms forward: F+B+W = 1.5 ms each
    assert rank_time_floor(runs, [0, 1], min_comm=0.0) == pytest.approx(4.5)
    assert rank_time_floor(runs, [0, 1, 1, 0], min_comm=0.0) == pytest.approx(4.5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(range(len(_PALETTE))), min_size=2, max_size=8),
       data=st.data())
def test_ilp_with_runs_reaches_brute_force_optimum(kinds, data):
    kinds = [k for k in kinds for _ in range(data.draw(st.integers(1, 3)))][:8]
    chain = _chain(kinds)
    found = check_ilp_against_brute_force(data, chain, [None, 600, 1000, 2000])
    if found is None:
        return
    sol, ranks, in_flight, limit = found
    if limit is not None:
        assert rank_memory(chain, sol.bounds, sol.recompute, ranks, in_flight) <= limit
    times = [chain.stage_time(i, j, int(r)) for (i, j), r in zip(sol.bounds, sol.recompute)]
    slowest = max(sum(t for t, q in zip(times, ranks) if q == r) for r in set(ranks))
    min_comm = float(chain.comm_at[1:-1].min())
    assert rank_time_floor(block_runs(chain), ranks, min_comm) <= slowest + 1e-9


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_both_backends_find_the_optimum_cbc_preprocessing_missed(backend):
    """Found by hypothesis: with its integer preprocessing CBC called recompute on the
    second stage (5.01 ms) optimal; no recompute (4.51 ms) is, and brute force agrees."""
    chain = _chain([1, 3])
    sol = solve_ilp(chain, stage_ranks=[0, 1], in_flight=[1, 1], num_microbatches=1,
                    limit_bytes=1000, limits=ILPLimits(backend=backend))
    expected = brute_force_ranks(chain, [0, 1], [1, 1], 1, 1000)
    assert sol.status == "optimal" and sol.objective_ms == pytest.approx(expected)
    assert sol.recompute == (False, False)


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_benchmark_case_is_proved_optimal(backend):
    """bench_solve.py (b): 128 blocks, pp 8, v 2, 40 GiB; both backends prove it."""
    chain = chain_of(llama_like(125, act_bytes=GIB // 4, head_ms=6.0))
    ranks = [stage_to_rank(s, 8, 2, "loop") for s in range(16)]
    in_flight = _BENCH_IN_FLIGHT
    sol = solve_ilp(chain, stage_ranks=ranks, in_flight=in_flight, num_microbatches=16,
                    limit_bytes=40 * GIB, limits=ILPLimits(backend=backend, time_limit_s=10))
    assert sol.status == "optimal" and sol.gap == 0.0
    assert sol.objective_ms == pytest.approx(
        rank_objective(chain, sol.bounds, sol.recompute, ranks, 16))
    edges = [i for i, _ in sol.bounds] + [chain.num_blocks]
    assert edges[0] == 0 and all(a < b for a, b in itertools.pairwise(edges))
    assert sol.objective_ms == pytest.approx(962.841432, rel=1e-9)


@pytest.mark.parametrize("num_layers,pp,v", [(14, 2, 2), (21, 3, 2), (10, 2, 3)])
def test_backends_break_ties_the_same_way(num_layers, pp, v):
    """Identical decoder layers make many splits equally fast: HiGHS and CBC, bounded by
    nodes (no clock), return the same split, the one with the earliest cuts."""
    chain = chain_of(llama_like(num_layers, head_ms=1.0))
    ranks = [stage_to_rank(s, pp, v, "loop") for s in range(pp * v)]
    sols = [solve_ilp(chain, stage_ranks=ranks, in_flight=[1] * (pp * v), num_microbatches=8,
                      limits=ILPLimits(backend=backend, max_nodes=10_000))
            for backend in ("highs", "cbc")]
    assert all(sol.status == "optimal" for sol in sols)
    assert sols[0].bounds == sols[1].bounds
    assert sols[0].objective_ms == pytest.approx(sols[1].objective_ms, rel=1e-12)


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_a_node_limit_returns_the_incumbent_split(backend):
    """A search the node limit stops returns its best split as ``limit`` with a gap, on
    both backends (PuLP 3.3 raises KeyError on HiGHS's node-limit status by itself)."""
    pytest.importorskip("highspy")
    rng = random.Random(0)
    blocks = [make_block(f"b{i}", fwd_ms=rng.uniform(0.5, 2.0),
                         num_params=rng.randint(1, 10) * 100_000,
                         activation_bytes=rng.randint(1, 50) * 2**20, output_bytes=2**20)
              for i in range(60)]
    chain = chain_of(make_profile(blocks), TrainingSetup(pp_size=4, num_microbatches=8))
    ranks = [s % 4 for s in range(12)]
    solution = solve_ilp(chain, stage_ranks=ranks, in_flight=[4] * 12, num_microbatches=8,
                         limits=ILPLimits(backend=backend, max_nodes=1))
    assert solution is not None and solution.status == "limit"
    starts = [i for i, _ in solution.bounds]
    ends = [j for _, j in solution.bounds]
    assert starts[0] == 0 and ends[-1] == 60 and starts[1:] == ends[:-1]
    assert solution.objective_ms == pytest.approx(
        rank_objective(chain, solution.bounds, solution.recompute, ranks, 8))

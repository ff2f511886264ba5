"""The DP's closed form against the simulator on chains with communication.

On a uniform chain the DP's objective (``autopart.solve.dp``, (1)) is the simulated
step: GPipe at any pp (sends overlap compute, every cut crossed twice on the fill and
drain) and 1F1B at pp = 2 (a round waits on its cut's transfer); 1F1B with more
stages is an upper bound within one cut's transfer.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solve_helpers import brute_force, make_block, make_profile

from autopart.cost.blocks import block_arrays
from autopart.cost.stage import stage_cost
from autopart.schedules import schedule_info
from autopart.schema import TrainingSetup
from autopart.simulate import simulate
from autopart.solve import solve_dp
from autopart.solve.chain import build_chain

_MS_PER_MB = 1e6
"""On the test link (1e9 bytes/s, no latency) a 1e6-byte cut takes 1 ms each way."""


def _dp_and_sim(schedule: str, pp: int, m: int, num_blocks: int, out_bytes: int
                ) -> tuple[float, float, float]:
    """(DP objective, simulated step of the DP's split, one cut's transfer in ms)."""
    setup = TrainingSetup(pp_size=pp, num_microbatches=m, link_latency_ms=0.0,
                          link_bandwidth_bytes_per_s=1e9)
    profile = make_profile([make_block(f"b{b}", fwd_ms=1.0, output_bytes=out_bytes)
                            for b in range(num_blocks)])
    arrays = block_arrays(profile, setup)
    dp = solve_dp(build_chain(arrays, setup), num_stages=pp, in_flight=[m] * pp,
                  limits_bytes=[None] * pp, weight=m - 1,
                  blocking=schedule_info(schedule).blocking_sends)
    costs = [stage_cost(arrays, i, j - 1) for i, j in dp.bounds]
    sim = simulate(costs, schedule=schedule, pp_size=pp, virtual_stages=1,
                   num_microbatches=m, setup=setup)
    return dp.objective_ms, sim.step_ms, out_bytes / _MS_PER_MB


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("out_bytes", [0, 500_000, 1_000_000])
def test_gpipe_closed_form_is_the_simulated_step(pp: int, out_bytes: int) -> None:
    """2 blocks of F 1, B+W 2 per stage: (m - 1) * 6 + pp * 6 + 2 * (pp - 1) * comm."""
    objective, step, comm = _dp_and_sim("gpipe", pp, 2 * pp, 2 * pp, out_bytes)
    assert objective == pytest.approx(step, rel=1e-9)
    assert step == pytest.approx((2 * pp - 1) * 6 + pp * 6 + 2 * (pp - 1) * comm)


@pytest.mark.parametrize("out_bytes", [0, 500_000, 1_000_000])
def test_1f1b_pp2_closed_form_is_the_simulated_step(out_bytes: int) -> None:
    """Each round waits on the one cut: (m - 1) * (6 + comm) + 2 * 6 + 2 * comm."""
    objective, step, comm = _dp_and_sim("1f1b", 2, 4, 4, out_bytes)
    assert objective == pytest.approx(step, rel=1e-9)
    assert step == pytest.approx(3 * (6 + comm) + 12 + 2 * comm)


@pytest.mark.parametrize("pp", [3, 4])
def test_1f1b_closed_form_bounds_the_simulated_step(pp: int) -> None:
    """A middle stage's round waits on both its cuts; the simulated step is at most one
    transfer below the closed form."""
    objective, step, comm = _dp_and_sim("1f1b", pp, 2 * pp, 2 * pp, 1_000_000)
    assert step <= objective + 1e-9
    assert objective - step <= comm + 1e-9


_blocks = st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0]),
                             st.sampled_from([0, 10**6, 3 * 10**6])), min_size=2, max_size=7)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_blocks, data=st.data())
def test_dp_with_blocking_sends_reaches_brute_force_optimum(spec, data) -> None:
    """Objective (1) with 1F1B's waits, over every split (varied cut sizes)."""
    setup = TrainingSetup(pp_size=1, num_microbatches=1, link_latency_ms=0.0,
                          link_bandwidth_bytes_per_s=1e9)
    profile = make_profile([make_block(f"b{i}", fwd_ms=f, output_bytes=o)
                            for i, (f, o) in enumerate(spec)])
    chain = build_chain(block_arrays(profile, setup), setup)
    num_stages = data.draw(st.integers(1, min(4, len(spec))))
    weight = data.draw(st.sampled_from([0, 1, 5]))
    expected = brute_force(chain, num_stages, [1] * num_stages, [None] * num_stages, weight,
                           blocking=True)
    sol = solve_dp(chain, num_stages=num_stages, in_flight=[1] * num_stages,
                   limits_bytes=[None] * num_stages, weight=weight, blocking=True)
    assert sol.objective_ms == pytest.approx(expected, rel=1e-9)

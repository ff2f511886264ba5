"""Property tests: DP and ILP reach the brute-force optimum on small random chains.

The reference enumerates every split and recompute choice (``solve_helpers``) under
the same objective and memory model as the solver it checks.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solve_helpers import (
    brute_force,
    chain_of,
    check_ilp_against_brute_force,
    make_block,
    make_profile,
)

from autopart.solve import baseline_split, solve_dp

_blocks = st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0, 3.0]),    # fwd_ms
                             st.integers(0, 40),                      # num_params
                             st.integers(0, 100),                     # activation_bytes
                             st.sampled_from([0, 10, 30, 10**9]),     # output_bytes
                             st.integers(0, 30)),                     # transient_bytes
                   min_size=1, max_size=8)


def _chain(spec):
    blocks = [make_block(f"b{i}", fwd_ms=f, num_params=p, activation_bytes=a, output_bytes=o,
                         transient_bytes=t) for i, (f, p, a, o, t) in enumerate(spec)]
    return chain_of(make_profile(blocks))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_blocks, data=st.data())
def test_dp_reaches_brute_force_optimum(spec, data):
    chain = _chain(spec)
    num_stages = data.draw(st.integers(1, min(4, len(spec))))
    in_flight = data.draw(st.lists(st.integers(1, 4), min_size=num_stages,
                                   max_size=num_stages))
    limit = data.draw(st.sampled_from([None, 400, 800, 1500, 3000]))
    weight = data.draw(st.sampled_from([0, 1, 3, 7]))
    expected = brute_force(chain, num_stages, in_flight, [limit] * num_stages, weight)
    sol = solve_dp(chain, num_stages=num_stages, in_flight=in_flight,
                   limits_bytes=[limit] * num_stages, weight=weight)
    if expected is None:
        assert sol is None
    else:
        assert sol.objective_ms == pytest.approx(expected, rel=1e-9)
        edges = [i for i, _ in sol.bounds] + [chain.num_blocks]
        assert edges[0] == 0 and all(a < b for a, b in itertools.pairwise(edges))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_blocks, data=st.data())
def test_ilp_reaches_brute_force_optimum(spec, data):
    check_ilp_against_brute_force(data, _chain(spec), [None, 800, 1500, 3000])


@settings(max_examples=100, deadline=None)
@given(kinds=st.lists(st.sampled_from(["block", "decoder_layer"]), min_size=1, max_size=12),
       data=st.data())
def test_baselines_cover_every_block_once(kinds, data):
    kinds = ["embedding", *kinds, "norm", "head"] if data.draw(st.booleans()) else kinds
    blocks = [make_block(f"b{i}", kind=k, num_params=data.draw(st.integers(0, 9)))
              for i, k in enumerate(kinds)]
    num_stages = data.draw(st.integers(1, len(blocks)))
    for name in ("even", "params", "torchtitan"):
        bounds = baseline_split(name, blocks, num_stages)
        assert len(bounds) == num_stages
        edges = [i for i, _ in bounds] + [len(blocks)]
        assert edges[0] == 0 and all(a < b for a, b in itertools.pairwise(edges)), (name, bounds)
        assert all(j == i2 for (_, j), (i2, _) in itertools.pairwise(bounds))

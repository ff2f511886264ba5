"""Disturbed measurements: re-measured while they spread, never reused, medians on disagreement.

The measurements are synthetic ``TimeFigures`` with hand-picked spreads and totals,
so each rule's outcome is known in advance.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from autopart.profile import engines, measure, profile_model
from autopart.profile.measure import TimeFigures
from autopart.profile.noise import recheck


def _t(total: float, spread: float = 0.0) -> TimeFigures:
    return TimeFigures(fwd_ms=total / 3, bwd_ms=2 * total / 3, bwd_input_ms=total / 3,
                       bwd_weight_ms=total / 3, fwd_ms_spread=spread, bwd_ms_spread=spread)


def _total(t: TimeFigures) -> float:
    return t.fwd_ms + t.bwd_ms


def _feed(monkeypatch, figures: list[TimeFigures]) -> list[TimeFigures]:
    queue = list(figures)
    monkeypatch.setattr(measure, "measure_times", lambda *a: queue.pop(0))
    return queue


def test_spread_measurement_is_measured_again_and_least_spread_kept(monkeypatch):
    left = _feed(monkeypatch, [_t(3.0, 0.5), _t(3.0, 0.3), _t(3.0, 0.25)])
    out = measure.measure_times_clean(None, None, 1, 5)
    assert not left and out.num_measurements == 3
    assert out.worst_spread == 0.25 and out.noisy


def test_clean_second_measurement_ends_the_retries(monkeypatch):
    left = _feed(monkeypatch, [_t(3.0, 0.5), _t(6.0, 0.1), _t(9.0, 0.0)])
    out = measure.measure_times_clean(None, None, 1, 5)
    assert len(left) == 1 and out.num_measurements == 2
    assert out.fwd_ms + out.bwd_ms == pytest.approx(6.0) and not out.noisy


def test_recheck_keeps_the_first_when_a_second_agrees():
    again = iter([_t(11.0)])
    assert recheck(_t(10.0), lambda: next(again), _total) == (_t(10.0), False)


def test_recheck_takes_the_median_of_three_on_disagreement():
    """6.8x off (the issue's case): 68 then 10, 11 -> the median 11 is kept."""
    again = iter([_t(10.0), _t(11.0)])
    kept, disagreed = recheck(_t(68.0), lambda: next(again), _total)
    assert disagreed and kept == _t(11.0)


def test_recheck_takes_the_spread_it_is_given():
    """Runs 12% apart agree at the blocks' 20% and disagree at a launch's 10%."""
    assert recheck(100.0, lambda: 112.0, float) == (100.0, False)
    again = iter([112.0, 95.0])
    assert recheck(100.0, lambda: next(again), float, 0.1) == (100.0, True)


def test_disturbed_blocks_are_not_reused(monkeypatch):
    """Every measurement stays noisy: identical blocks are each measured themselves."""
    monkeypatch.setattr(engines, "measure_times_clean", lambda *a: dataclasses.replace(
        measure.measure_times(*a), num_measurements=3, noisy=True))
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2))
    profile = profile_model(model, num_warmup=1, num_repeats=2, seq_len=16)
    assert [b.reused_from for b in profile.blocks] == [None] * 5
    assert all(b.noisy and b.num_measurements == 3 for b in profile.blocks)
    assert len(profile.setup.load_average) == 2


def test_table_marks_disturbed_blocks(monkeypatch):
    from cli.cmd_profile import summary_table

    monkeypatch.setattr(engines, "measure_times_clean", lambda *a: dataclasses.replace(
        measure.measure_times(*a), noisy=True))
    profile = profile_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), num_warmup=1,
                            num_repeats=2, seq_len=16)
    table = summary_table(profile)
    times = next(c for c in table.columns if c.header == "times")
    assert list(times._cells) == ["noisy", "noisy"]

"""Disturbed measurements: re-measure a reused block once, and keep the median when it disagrees.

Identical blocks are measured once and reused (``profiler``), so one disturbed
measurement would spread to every layer. The first time a measurement is about to
be reused, the call is measured again; when the two disagree (F + B differ by more
than ``NOISE_SPREAD``) it is measured a third time and the median of the three is
kept, flagged as disagreeing. A measurement whose repeats still spread after
``measure_times_clean`` is never reused: each identical block is measured itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from autopart.profile.measure import TimeFigures, agree

__all__ = []

T = TypeVar("T")


def recheck(first: T, measure: Callable[[], T],
            times: Callable[[T], TimeFigures]) -> tuple[T, bool]:
    """Measure again; return what to reuse and whether the measurements disagreed.

    Args:
        first: The measurement about to be reused.
        measure: Measures the same call again.
        times: The times of a measurement.

    Returns:
        ``(first, False)`` when a second measurement agrees with it, else the median
        (by F + B) of three measurements and ``True``.
    """
    second = measure()
    if agree(times(first), times(second)):
        return first, False
    third = measure()
    ranked = sorted((first, second, third),
                    key=lambda m: times(m).fwd_ms + times(m).bwd_ms)
    return ranked[1], True


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0

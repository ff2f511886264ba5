"""Disturbed measurements: re-measure a reused block once, and keep the median when it disagrees.

Identical blocks are measured once and reused (``profiler``), so one disturbed
measurement would spread to every layer. The first time a measurement is about to
be reused, the call is measured again; when the two disagree (F + B differ by more
than ``NOISE_SPREAD``) it is measured a third time and the median of the three is
kept, flagged as disagreeing. A measurement whose repeats still spread after
``measure_times_clean`` is never reused: each identical block is measured itself.
A whole run is launched again the same way where a host's slow spells move a run's step
from launch to launch (``autopart.verify.run.verify_steadily``, which pools two launches
that agree).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from autopart.profile.measure import NOISE_SPREAD

__all__ = []

T = TypeVar("T")


def recheck(first: T, measure: Callable[[], T], size: Callable[[T], float],
            spread: float = NOISE_SPREAD) -> tuple[T, bool]:
    """Measure again; return what to reuse and whether the measurements disagreed.

    Args:
        first: The measurement about to be reused.
        measure: Measures the same thing again.
        size: What two measurements must agree on (a block call's F + B, a run's step).
        spread: The most two measurements' sizes may differ by, over the smaller.

    Returns:
        ``(first, False)`` when a second measurement agrees with it, else the median
        (by ``size``) of three measurements and ``True``.
    """
    second = measure()
    if agree(size(first), size(second), spread):
        return first, False
    third = measure()
    return sorted((first, second, third), key=size)[1], True


def agree(first: float, second: float, spread: float = NOISE_SPREAD) -> bool:
    """Whether two measured sizes agree: within ``spread`` of the smaller (a size of 0
    agrees with anything: nothing was measured)."""
    low = min(first, second)
    return low <= 0 or abs(first - second) / low <= spread


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0

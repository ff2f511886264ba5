"""Busy neighbours (``autopart.profile.neighbours``): started, recorded, stopped."""

from __future__ import annotations

import multiprocessing

import pytest

from autopart.errors import ProfileError
from autopart.intake import load_model
from autopart.profile import profile_model
from autopart.profile.neighbours import busy_neighbours

FAST = {"seq_len": 16, "num_warmup": 0, "num_repeats": 1}


def test_a_module_object_cannot_have_neighbours():
    model = load_model("tiny-llama").model
    with pytest.raises(ProfileError, match="source string"):
        with busy_neighbours(model, 1, 1, {}, profile_model):
            pass


def test_no_neighbours_runs_the_block_alone():
    with busy_neighbours(object(), 0, 1, {}, profile_model):
        assert not multiprocessing.active_children()


def test_neighbours_are_for_the_cpu_backend():
    with pytest.raises(ProfileError, match="cpu backend"):
        profile_model("tiny-llama", backend="analytical:h100", neighbours=1, **FAST)


@pytest.mark.parametrize("setting", [{"clock": "thread"}, {"cache_flush": "llc"}])
def test_timing_settings_are_refused_where_nothing_is_timed(setting):
    """An analytical profile estimates times: a clock or cache flush asked for is not
    silently ignored."""
    with pytest.raises(ProfileError, match="leave both at auto"):
        profile_model("tiny-llama", backend="analytical:h100", **setting, **FAST)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_profile_with_a_busy_neighbour_records_it_and_stops_it():
    profile = profile_model("tiny-llama", neighbours=1, **FAST)
    assert profile.setup.neighbours == 1
    assert profile.setup.time_source.endswith("beside 1 busy neighbour process(es)")
    assert all(b.fwd_ms > 0 for b in profile.blocks)
    assert not multiprocessing.active_children()  # the neighbour was stopped and joined

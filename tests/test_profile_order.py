"""The CPU ``order`` method: forwards timed again in model order (autopart.profile.order)."""

from __future__ import annotations

import pytest
from conftest import hold_steady

from autopart.errors import ProfileError
from autopart.profile import order, profile_model, profiler
from autopart.profile.backends import make_backend
from autopart.profile.engines import Figures
from autopart.profile.measure import MemoryFigures, TimeFigures

FAST = {"num_warmup": 1, "num_repeats": 2, "seq_len": 16}


def _call(fwd: float, bwd: float = 1.0) -> profiler._CallFigures:
    times = TimeFigures(fwd_ms=fwd, bwd_ms=bwd, bwd_input_ms=bwd / 2, bwd_weight_ms=bwd / 2)
    return profiler._CallFigures(Figures(times, MemoryFigures(100, 10, 5), ()), 0, 0)


def test_each_kind_takes_its_calls_median_ratios_forward_and_backward_apart():
    done = {0: (_call(1.0), "embed"), 1: (_call(2.0), "layer"), 2: (_call(2.0), "layer"),
            3: (_call(2.0), "layer"), 4: (_call(4.0, 0.0), "head")}
    fwd = [1.5, 2.2, 3.0, 2.6, 4.0]  # layer ratios 1.1, 1.5, 1.3: median 1.3
    bwd = [1.0, 1.2, 1.1, 1.0, 0.0]  # layer ratios 1.2, 1.1, 1.0: median 1.1
    out = order.in_order(done, {}, order.InOrder(fwd, bwd))
    times = {i: c.figures.times for i, (c, _) in out.items()}
    assert {i: round(t.fwd_ms, 6) for i, t in times.items()} == {
        0: 1.5, 1: 2.6, 2: 2.6, 3: 2.6, 4: 4.0}  # twins stay identical
    for i in (1, 2, 3):  # full, B and W take the full backward's ratio
        assert (times[i].bwd_ms, times[i].bwd_input_ms, times[i].bwd_weight_ms) == (
            pytest.approx(1.1), pytest.approx(0.55), pytest.approx(0.55))
    assert times[0].bwd_ms == 1.0 and times[4].bwd_ms == 0.0  # nothing timed: unchanged
    assert all(out[i][1] == done[i][1] for i in done)


def test_backwards_take_the_joined_backward_over_the_calls_sum():
    done = {0: (_call(1.0, 2.0), "embed"), 1: (_call(2.0, 4.0), "layer"),
            2: (_call(2.0, 4.0), "layer")}
    timed = order.InOrder([1.0, 2.0, 2.0], [2.0, 4.0, 4.0], joined_bwd_ms=8.0)  # 8 / 10
    out = order.in_order(done, {}, timed)
    times = [out[i][0].figures.times for i in range(3)]
    assert [t.bwd_ms for t in times] == pytest.approx([1.6, 3.2, 3.2])
    assert [t.bwd_weight_ms for t in times] == pytest.approx([0.8, 1.6, 1.6])
    assert [t.fwd_ms for t in times] == pytest.approx([1.0, 2.0, 2.0])  # forwards as timed
    unjoined = order.in_order(done, {}, order.InOrder([1.0, 2.0, 2.0], [2.0, 4.0, 4.0]))
    assert unjoined[1][0].figures.times.bwd_ms == pytest.approx(4.0)


def test_a_split_half_and_its_child_take_the_whole_calls_ratio():
    # call 1 was measured as P less its child C (call 2); in order it runs whole
    done = {0: (_call(1.0), "embed"), 1: (_call(3.0), "half"), 2: (_call(1.0), "half#out")}
    out = order.in_order(done, {1: 2}, order.InOrder([1.0, 6.0, 0.0], [1.0, 3.0, 0.0]))
    assert out[1][0].figures.times.fwd_ms == pytest.approx(4.5)
    assert out[2][0].figures.times.fwd_ms == pytest.approx(1.5)
    assert out[1][0].figures.times.bwd_ms == pytest.approx(1.5)
    assert out[2][0].figures.times.bwd_ms == pytest.approx(1.5)


def test_the_order_flush_times_like_the_model_flush_and_cuda_refuses_it():
    backend = make_backend("cpu", "order")
    assert backend.times_in_order and backend.warms_a_copy
    assert not make_backend("cpu", "model").times_in_order
    backend.size_flush(1 << 20)
    assert backend.flush_bytes == 1 << 20
    assert backend.time_source.endswith(
        "forwards scaled to their times in model order, backwards to the model's one backward")
    with pytest.raises(ProfileError, match="expected auto, none, llc, model, order"):
        make_backend("cpu", "order2")


def test_the_profile_carries_the_in_order_forwards(monkeypatch):
    hold_steady(monkeypatch)
    seen = {}
    real = order.in_order

    def spy(done, splits, timed):
        seen["timed"], seen["splits"] = timed, splits
        seen["out"] = real(done, splits, timed)
        return seen["out"]

    monkeypatch.setattr(order, "in_order", spy)
    prof = profile_model("tiny-llama", cache_flush="order", **FAST)
    assert prof.setup.time_source.startswith("measured:")
    assert "forwards scaled to their times in model order" in prof.setup.time_source
    assert len(seen["timed"].fwd_ms) == len(seen["out"])
    # the whole model as one graph backs up faster than its calls one by one
    assert 0 < seen["timed"].joined_bwd_ms < 1.5 * sum(seen["timed"].bwd_ms)
    children = set(seen["splits"].values())  # run inside their split half, not on their own
    assert children
    for i, (fwd, bwd) in enumerate(zip(seen["timed"].fwd_ms, seen["timed"].bwd_ms)):
        assert (fwd > 0 and bwd > 0) != (i in children)
    assert all(block.fwd_ms > 0 for block in prof.blocks)
    by_name = {b.name: b for b in prof.blocks}
    twins = [b for b in prof.blocks if b.reused_from]
    assert twins  # a twin takes its kind's one ratio: the same forward as the first
    for block in twins:
        assert block.fwd_ms == by_name[block.reused_from].fwd_ms


def test_the_pass_is_skipped_and_said_so_where_the_model_does_not_fit(monkeypatch):
    hold_steady(monkeypatch)
    monkeypatch.setattr(order, "fits_in_memory", lambda *_: False)
    monkeypatch.setattr(order, "time_in_order",
                        lambda *_, **__: pytest.fail("the pass ran"))
    prof = profile_model("tiny-llama", cache_flush="order", **FAST)
    assert "not in model order" in prof.setup.time_source


def test_neighbours_load_the_machine_without_the_order_passes(monkeypatch):
    from contextlib import contextmanager

    hold_steady(monkeypatch)
    seen = {}

    @contextmanager
    def record(source, count, threads, settings, work):
        seen.update(settings)
        yield

    monkeypatch.setattr(profiler, "busy_neighbours", record)
    prof = profile_model("tiny-llama", neighbours=1, **FAST)
    assert "model order" in prof.setup.time_source  # this process ran them
    assert seen["cache_flush"] == "model" and seen["neighbours"] == 0

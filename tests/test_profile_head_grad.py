"""The split head's per-step costs: the gradient's zero-fill (hand-worked estimate, a
real measurement on CPU, its place in the shard stages' F) and the sum of a shared
weight's gradient over its holders."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from solve_helpers import llama_like

from autopart.cost.blocks import block_arrays
from autopart.cost.rank import shared_grad_sync_ms
from autopart.cost.stage import StageCost, stage_cost
from autopart.levels import split_head
from autopart.profile.devices import load_device_spec
from autopart.profile.head_grad import estimate_head_grad_ms, measure_head_grad_ms
from autopart.schema import RuntimeOverhead, TrainingSetup
from autopart.solve.choices import Choice, choice_notes


def test_estimate_is_one_pass_over_the_weight_at_the_specs_bandwidth():
    """Llama-3.2-1B's head, 128256 x 2048 bf16 on an H100: 2 * 262,668,288 B =
    525,336,576 B at 3.35 TB/s * 0.8 = 0.19602 ms."""
    ms = estimate_head_grad_ms(128256 * 2048, load_device_spec("h100"), "bfloat16")
    assert ms == pytest.approx(525_336_576 / 2.68e12 * 1e3, rel=1e-9)


def test_measure_times_a_zero_filled_allocation_on_cpu():
    ms = measure_head_grad_ms((256, 64), torch.float32, torch.device("cpu"), num_repeats=3)
    assert 0 < ms < 1000


def test_a_stage_with_shards_pays_the_zero_fill_once_per_step_in_its_f():
    """Head split in 4 (1000 rows), a 2 ms zero-fill per step over 4 microbatches: a
    stage with one shard or three adds 0.5 ms to each F and nothing to W (the shards'
    backward adds only their rows, within the head's W / 4 each); a stage without
    shards pays nothing."""
    profile = llama_like(4, head_ms=6.0)
    profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, head_split_rows=1000),
        setup=dataclasses.replace(profile.setup, head_grad_ms=2.0))
    head = profile.blocks[-1]
    split = split_head(profile, 4)
    arrays = block_arrays(split, TrainingSetup(pp_size=2, num_microbatches=4))
    n = len(split.blocks)
    last, three = stage_cost(arrays, n - 1, n - 1), stage_cost(arrays, n - 3, n - 1)
    assert last.fwd_ms == pytest.approx(head.fwd_ms / 4 + 0.5)
    assert three.fwd_ms == pytest.approx(3 * head.fwd_ms / 4 + 0.5)
    assert last.bwd_weight_ms == pytest.approx(head.bwd_weight_ms / 4)
    layers = stage_cost(arrays, 0, n - 5)
    assert layers.fwd_ms == pytest.approx(sum(b.fwd_ms for b in split.blocks[:n - 4]))
    (note,) = choice_notes(profile, Choice("layer", 4))
    assert "zero-fills its gradient once per step (2 ms, measured)" in note
    unrecorded = dataclasses.replace(profile, setup=dataclasses.replace(profile.setup,
                                                                        head_grad_ms=0.0))
    assert "re-profile to count it" in choice_notes(unrecorded, Choice("layer", 4))[0]


def _stage(held: bool) -> StageCost:
    return StageCost(fwd_ms=1.0, bwd_input_ms=1.0, bwd_weight_ms=1.0, static_bytes=0,
                     activation_bytes=0, input_bytes=0, output_bytes=0, transient_bytes=0,
                     param_count=0, held=(("lm_head", 64_000_000),) if held else ())


def test_shared_gradient_sum_is_a_ring_all_reduce_over_its_holders():
    """A 4M-parameter weight (fp32 + Adam: 16 B/param, 64 MB static, 16 MB gradient) on
    a 50 GB/s, 0.01 ms link: 2 holders move 16 MB in 2 steps = 0.32 + 0.02 ms; 3 move
    4/3 * 16 MB in 4 steps = 0.42667 + 0.04 ms; one holder (two stages on one rank) or
    none: 0."""
    setup = TrainingSetup(pp_size=3, num_microbatches=4, link_bandwidth_bytes_per_s=50e9,
                          link_latency_ms=0.01)
    costs = [_stage(True), _stage(False), _stage(True)]
    assert shared_grad_sync_ms(costs, [0, 1, 1], setup) == pytest.approx(0.34)
    assert shared_grad_sync_ms(costs, [0, 1, 2], setup) == pytest.approx(0.34)
    assert shared_grad_sync_ms([_stage(True)] * 3, [0, 1, 2],
                               setup) == pytest.approx(0.46667, rel=1e-4)
    assert shared_grad_sync_ms(costs, [1, 0, 1], setup) == 0.0
    assert shared_grad_sync_ms([_stage(False)] * 3, [0, 1, 2], setup) == 0.0


def test_shared_gradient_sum_at_the_measured_all_reduce_speed():
    """The machine check timed the all-reduce (2 ms fixed, 1 GB/s): on its own link the
    16 MB gradient takes 2 + 16 ms between two holders (3 holders: 4 ring steps of 1 ms
    + 4/3 * 16 ms); on a link given by the user, the link's figures as before."""
    check = RuntimeOverhead(fwd_action_ms=0.0, bwd_action_ms=0.0, p2p_ms=0.0, step_ms=0.0,
                            link_latency_ms=0.01, link_bandwidth_bytes_per_s=50e9,
                            backend="gloo", num_threads=1, allreduce_latency_ms=2.0,
                            allreduce_bandwidth_bytes_per_s=1e9)
    setup = TrainingSetup(pp_size=3, num_microbatches=4, link_bandwidth_bytes_per_s=50e9,
                          link_latency_ms=0.01, runtime_overhead=check)
    costs = [_stage(True), _stage(False), _stage(True)]
    assert shared_grad_sync_ms(costs, [0, 1, 2], setup) == pytest.approx(18.0)
    assert shared_grad_sync_ms([_stage(True)] * 3, [0, 1, 2],
                               setup) == pytest.approx(4.0 + 64 / 3)
    given = dataclasses.replace(setup, link_bandwidth_bytes_per_s=25e9)
    assert shared_grad_sync_ms(costs, [0, 1, 2], given) == pytest.approx(0.02 + 0.64)


def test_the_sliced_loss_line_is_fitted_over_every_size():
    """Three sizes on one line give its fixed cost and cost per row exactly; noise that
    tilts the line below the origin leaves no fixed cost (the mean cost per row), and a
    fit through two of them alone would have read a fixed cost the third denies."""
    from autopart.profile.head_grad import _line

    assert _line([(100, 1.5), (200, 2.5), (300, 3.5)]) == pytest.approx((0.5, 0.01))
    fixed, per_row = _line([(100, 0.5), (200, 2.5), (300, 3.0)])
    assert fixed == 0.0 and per_row == pytest.approx(6.0 / 600)
    fixed, per_row = _line([(100, 2.0), (200, 3.0), (300, 5.0)])  # two alone: 1.0 fixed
    assert fixed == pytest.approx(0.3333, abs=1e-4) and per_row == pytest.approx(0.015)

"""The full-size gradient each head shard's backward writes: hand-worked estimate, a
real measurement on CPU, and its place in the shard blocks' W."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from solve_helpers import llama_like

from autopart.cost import block_arrays, stage_cost
from autopart.profile.devices import load_device_spec
from autopart.profile.head_grad import estimate_head_grad_ms, measure_head_grad_ms
from autopart.schema import TrainingSetup
from autopart.solve.shards import apply_granularity, split_head


def test_estimate_is_four_passes_over_the_weight_at_the_specs_bandwidth():
    """Llama-3.2-1B's head, 128256 x 2048 bf16 on an H100: 4 * 2 * 262,668,288 B =
    2,101,346,304 B at 3.35 TB/s * 0.8 = 0.78408 ms (the adds' FLOPs are far cheaper)."""
    ms = estimate_head_grad_ms(128256 * 2048, load_device_spec("h100"), "bfloat16")
    assert ms == pytest.approx(2_101_346_304 / 2.68e12 * 1e3, rel=1e-9)


def test_measure_times_a_zero_fill_and_add_on_cpu():
    ms = measure_head_grad_ms((256, 64), torch.float32, torch.device("cpu"), num_repeats=3)
    assert 0 < ms < 1000


def test_a_stage_with_shards_pays_the_full_gradient_write_once_in_its_w():
    """Head W 6 ms split in 4 (1000 rows), a 0.5 ms gradient write: the shards keep W / 4
    each, and a stage pays 0.5 ms once whether it holds one shard or three (the runtime
    slices its rows once); a stage without shards pays nothing."""
    profile = llama_like(4, head_ms=6.0)
    profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, head_split_rows=1000),
        setup=dataclasses.replace(profile.setup, head_grad_ms=0.5))
    head = profile.blocks[-1]
    split = split_head(profile, 4)
    assert [b.bwd_weight_ms for b in split.blocks[-4:]] == pytest.approx(
        [head.bwd_weight_ms / 4] * 4)
    arrays = block_arrays(split, TrainingSetup(pp_size=2, num_microbatches=4))
    n = len(split.blocks)
    w_shards = head.bwd_weight_ms / 4
    assert stage_cost(arrays, n - 1, n - 1).bwd_weight_ms == pytest.approx(w_shards + 0.5)
    assert stage_cost(arrays, n - 3, n - 1).bwd_weight_ms == pytest.approx(3 * w_shards + 0.5)
    layers = stage_cost(arrays, 0, n - 5)
    assert layers.bwd_weight_ms == pytest.approx(sum(b.bwd_weight_ms
                                                     for b in split.blocks[:n - 4]))
    note = apply_granularity(profile, "auto", None, shards=4)[1][0]
    assert note.endswith("gradient of it per microbatch (0.5 ms, measured)")
    unrecorded = dataclasses.replace(profile, setup=dataclasses.replace(profile.setup,
                                                                        head_grad_ms=0.0))
    assert "re-profile to count it" in apply_granularity(unrecorded, "auto", None)[1][0]

"""The full-size gradient each head shard's backward writes: hand-worked estimate, a
real measurement on CPU, and its place in the shard blocks' W."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from solve_helpers import llama_like

from autopart.profile.devices import load_device_spec
from autopart.profile.head_grad import estimate_head_grad_ms, measure_head_grad_ms
from autopart.solve.shards import apply_granularity, split_head


def test_estimate_is_four_passes_over_the_weight_at_the_specs_bandwidth():
    """Llama-3.2-1B's head, 128256 x 2048 bf16 on an H100: 4 * 2 * 262,668,288 B =
    2,101,346,304 B at 3.35 TB/s * 0.8 = 0.78408 ms (the adds' FLOPs are far cheaper)."""
    ms = estimate_head_grad_ms(128256 * 2048, load_device_spec("h100"), "bfloat16")
    assert ms == pytest.approx(2_101_346_304 / 2.68e12 * 1e3, rel=1e-9)


def test_measure_times_a_zero_fill_and_add_on_cpu():
    ms = measure_head_grad_ms((256, 64), torch.float32, torch.device("cpu"), num_repeats=3)
    assert 0 < ms < 1000


def test_each_shard_pays_the_full_gradient_write_in_its_weight_backward():
    """Head W 6 ms split in 4 (1000 rows): each shard's W = 6 / 4 + 0.5 ms of gradient
    write, B unchanged (6 / 4), so the shards together cost 4 * 0.5 ms more than the head."""
    profile = llama_like(4, head_ms=6.0)
    profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, head_split_rows=1000),
        setup=dataclasses.replace(profile.setup, head_grad_ms=0.5))
    head = profile.blocks[-1]
    shards = split_head(profile, 4).blocks[-4:]
    assert [b.bwd_weight_ms for b in shards] == pytest.approx([head.bwd_weight_ms / 4 + 0.5] * 4)
    assert [b.bwd_input_ms for b in shards] == pytest.approx([head.bwd_input_ms / 4] * 4)
    assert sum(b.bwd_ms for b in shards) == pytest.approx(head.bwd_ms + 2.0)
    note = apply_granularity(profile, "auto", None, shards=4)[1][0]
    assert note.endswith("gradient of it (0.5 ms, measured)")
    unrecorded = dataclasses.replace(profile, setup=dataclasses.replace(profile.setup,
                                                                        head_grad_ms=0.0))
    assert "re-profile to count it" in apply_granularity(unrecorded, "auto", None)[1][0]

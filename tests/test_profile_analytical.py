"""Analytical backend: roofline arithmetic by hand, flash attention, 70B without allocation."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopart.errors import ProfileError
from autopart.intake import discover_blocks, load_model
from autopart.levels import coarsen
from autopart.profile import list_devices, load_device_spec, parse_backend, profile_model
from autopart.profile.analytical import Roofline, estimate_times, flash_sdpa
from autopart.profile.measure import memory_pass
from autopart.profile.tasks import BlockTask


def test_devices_have_specs_and_sources():
    assert set(list_devices()) >= {"h100", "h200", "a100", "trn1", "trn2"}
    for key in list_devices():
        spec = load_device_spec(key)
        assert spec.source.startswith("https://")
        assert set(spec.peak_flops) == {"float32", "bfloat16", "float16"}
        assert spec.peak_flops["bfloat16"] > spec.peak_flops["float32"] > 0
        assert spec.memory_bandwidth_bytes_per_s > 0 and spec.memory_bytes > 0
        assert 0 < spec.compute_efficiency <= 1 and 0 < spec.memory_efficiency <= 1
    assert load_device_spec("H100").peak_flops["bfloat16"] == 989e12


def test_unknown_device_lists_known_ones():
    with pytest.raises(ProfileError, match="unknown device 'v100'.*a100, h100, h200, trn1, trn2"):
        load_device_spec("v100")


def test_roofline_time_of_one_op():
    spec = load_device_spec("h100")
    compute = spec.op_time_s(1e12, 0, "bfloat16")
    assert compute == pytest.approx(1e12 / (989e12 * spec.compute_efficiency))
    memory = spec.op_time_s(0, 1e9, "bfloat16")
    assert memory == pytest.approx(1e9 / (3.35e12 * spec.memory_efficiency))
    assert spec.op_time_s(1e12, 1e9, "bfloat16") == max(compute, memory)


def test_linear_block_flops_and_bytes_by_hand():
    """Linear(k, n) on [m, k]: 2mkn FLOPs forward; dX and dW are 2mkn each."""
    spec = load_device_spec("a100")
    m, k, n = 64, 128, 256
    with torch.device("meta"):
        lin = nn.Linear(k, n, bias=False)
        x = torch.empty(m, k, requires_grad=True)
    task = BlockTask(run=lin, inputs=x, input_grad=True, loss_output=False, module=lin)
    roof = Roofline(spec, "float32")
    with roof:
        out = task.forward()
    assert roof.flops["fwd"] == 2 * m * k * n
    fwd_bytes = (m * k + n * k + m * n) * 4
    expected_s = spec.op_time_s(2 * m * k * n, fwd_bytes, "float32")
    assert roof.ms("fwd") == pytest.approx(expected_s * 1e3)
    times = estimate_times(task, spec, "float32")
    assert times.fwd_ms == pytest.approx(roof.ms("fwd"))
    assert times.bwd_input_ms + times.bwd_weight_ms == pytest.approx(times.bwd_ms)
    assert times.bwd_input_ms == pytest.approx(times.bwd_weight_ms, rel=0.05)
    del out


def test_flash_attention_flops_and_saved_bytes():
    b, h, s, d = 2, 4, 128, 32
    spec = load_device_spec("h100")
    with torch.device("meta"):
        q, k, v = (torch.empty(b, h, s, d, requires_grad=True) for _ in range(3))
    roof = Roofline(spec, "float32")
    with flash_sdpa(roof), roof:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        roof.phase = "bwd"
        out.sum().backward()
    assert roof.flops["fwd"] == 4 * b * h * s * s * d / 2
    assert roof.flops["bwd"] == 2.5 * roof.flops["fwd"]
    assert out.shape == (b, h, s, d) and q.grad.shape == q.shape


def test_flash_correction_drops_the_s_squared_probabilities():
    """The math path on meta saves [b, h, s, s] probabilities; the flash stand-in does not."""
    b, h, s, d = 1, 4, 256, 16
    with torch.device("meta"):
        x = torch.empty(b, h, s, d)

    def attention(t: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(t, t, t, is_causal=True)

    task = BlockTask(run=attention, inputs=x.requires_grad_(True), input_grad=True,
                     loss_output=False, module=nn.Identity())
    with flash_sdpa():
        flash = memory_pass(task).activation_bytes
    math = memory_pass(task).activation_bytes
    qkv_out_lse = (2 * b * h * s * d + b * h * s) * 4  # input (q=k=v) + output + logsumexp
    assert flash == qkv_out_lse
    assert math >= flash + b * h * s * s * 4 - b * h * s * 4


def test_analytical_profile_of_tiny_llama():
    profile = profile_model("tiny-llama", backend="analytical:h100", seq_len=64)
    assert profile.setup.time_source.startswith("estimated")
    assert profile.setup.memory_source.startswith("computed")
    assert profile.setup.device_name == "NVIDIA H100 SXM5 80GB"
    assert profile.setup.backend == "analytical:h100" and profile.setup.num_repeats == 0
    for block in profile.blocks:
        assert block.measured == () and block.fwd_ms > 0 and block.bwd_ms > 0
    assert profile.blocks[0].bwd_input_ms == 0.0
    # the split head's gradient zero-filled once per step: one pass of 512 x 64 float32
    assert profile.setup.head_grad_ms == pytest.approx(round(131_072 / 2.68e9, 6))


def test_analytical_dtype_scales_compute_bound_time():
    fp32 = profile_model("llama-3-8b", backend="analytical:h100", seq_len=2048)
    bf16 = profile_model("llama-3-8b", backend="analytical:h100", seq_len=2048, dtype="bfloat16")
    assert fp32.blocks[1].fwd_ms > 5 * bf16.blocks[1].fwd_ms
    assert fp32.blocks[1].param_bytes == 2 * bf16.blocks[1].param_bytes


def test_llama_70b_in_seconds_without_allocating():
    loaded = load_model("llama-3-70b")
    process = psutil.Process()
    rss = process.memory_info().rss
    start = time.perf_counter()
    profile = profile_model(loaded, backend="analytical:h100", seq_len=4096, dtype="bfloat16",
                            granularity="layer")
    seconds = time.perf_counter() - start
    grown = process.memory_info().rss - rss
    assert seconds < 10, seconds
    assert grown < 300 * 2**20, grown  # one bf16 70B layer alone would be 1.7 GB
    assert len(profile.blocks) == 83
    assert sum(b.reused_from is None for b in profile.blocks) == 4
    assert profile.model.num_params == pytest.approx(70.55e9, rel=1e-3)
    assert all(p.is_meta for p in loaded.model.parameters())
    layer = profile.blocks[1]
    assert layer.param_bytes == 2 * layer.num_params
    # 80 layers * (F + B + W) of a 70B model at 4096 tokens is seconds on one H100,
    # not ms or minutes
    total_s = sum(b.fwd_ms + b.bwd_ms for b in profile.blocks) / 1e3
    assert 1.0 < total_s < 10.0
    assert discover_blocks(loaded.model).fingerprint == profile.model.fingerprint


def test_llama_70b_default_level_measures_each_kind_of_part_once():
    """At the default (finest) level each of the 80 layers is four pieces; only the
    embedding, layer 0's four pieces, the norm and the head are estimated, the rest reused,
    and fusing the pieces back gives the layer profile's figures."""
    profile = profile_model("llama-3-70b", backend="analytical:h100", seq_len=4096,
                            dtype="bfloat16")
    layers = profile_model("llama-3-70b", backend="analytical:h100", seq_len=4096,
                           dtype="bfloat16", granularity="layer")
    assert profile.setup.granularity == "projection" and len(profile.blocks) == 3 + 4 * 80
    assert sum(b.reused_from is None for b in profile.blocks) == 7
    fused = coarsen(profile, "layer")
    assert [b.name for b in fused.blocks] == [b.name for b in layers.blocks]
    assert [b.num_params for b in fused.blocks] == [b.num_params for b in layers.blocks]
    assert fused.blocks[1].fwd_ms == pytest.approx(layers.blocks[1].fwd_ms, rel=0.02)
    assert layers.model.fingerprint == profile.model.fingerprint


def test_missing_dtype_peak_is_a_profile_error(monkeypatch):
    from autopart.profile import validate

    spec = load_device_spec("trn1")
    limited = type(spec)(**{**{f: getattr(spec, f) for f in spec.__slots__},
                            "peak_flops": {"bfloat16": 1e12}})
    monkeypatch.setattr(validate, "load_device_spec", lambda name: limited)
    with pytest.raises(ProfileError, match="no peak FLOP/s for dtype float32"):
        profile_model("tiny-llama", backend="analytical:trn1", seq_len=16)


@pytest.mark.parametrize(("text", "parsed"), [
    ("cpu", ("cpu", None)), (" CUDA ", ("cuda", None)), ("xla", ("xla", None)),
    ("analytical:H100", ("analytical", "h100")), ("analytical:trn2", ("analytical", "trn2")),
])
def test_parse_backend(text, parsed):
    name = parse_backend(text)
    assert (name.kind, name.device) == parsed
    assert str(name) == (f"analytical:{parsed[1]}" if parsed[1] else parsed[0])


@pytest.mark.parametrize(("text", "message"), [
    ("analytical", "needs a device"), ("analytical:nope", "unknown device 'nope'"),
    ("tpu", "unknown backend 'tpu'"), ("cpu:0", "unknown backend 'cpu:0'"),
])
def test_parse_backend_rejects(text, message):
    with pytest.raises(ProfileError, match=message):
        parse_backend(text)

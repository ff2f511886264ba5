"""The projection level: each layer half cut before its output projection where exact.

Expected blocks, crossing values and bytes are written out by hand from each family's
layer code (Llama: attention output + residual, act(gate) * up + residual); halves whose
cut would carry an integer tensor (an MoE router's indices) or a value made inside the
half stay whole with a note.
"""

from __future__ import annotations

import pytest
from families import tiny_config

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.levels import coarsen
from autopart.profile import profile_model
from autopart.solve import make_plan


def _projection(model_type: str):
    return discover_blocks(build_hf_model(tiny_config(model_type)), granularity="projection")


def test_llama_halves_split_before_o_proj_and_down_proj():
    chain = _projection("llama")
    assert chain.granularity == "projection" and not chain.notes and len(chain.blocks) == 19
    layer = "model.layers.0"
    assert chain.names[1:5] == [f"{layer}.self_attn.v_proj", f"{layer}.self_attn.o_proj",
                                f"{layer}.mlp.up_proj", f"{layer}.mlp.down_proj"]
    assert chain.blocks[1].modules == (f"{layer}.input_layernorm", f"{layer}.self_attn.q_proj",
                                       f"{layer}.self_attn.k_proj", f"{layer}.self_attn.v_proj")
    assert [b.kind for b in chain.blocks[1:5]] == ["attention", "attention", "mlp", "mlp"]
    # the forward calls the half's module, then its output projection
    assert chain.call_fqns[1:4] == [f"{layer}.input_layernorm", f"{layer}.self_attn",
                                    f"{layer}.self_attn.o_proj"]
    assert chain.splits[:2] == ((2, 3), (5, 6))


def test_the_residual_crosses_beside_the_projection_input():
    """Before o_proj the residual (input_layernorm's argument, call 1, leaf 0) rides along;
    before down_proj post_attention_layernorm's (call 4); plain cuts carry nothing."""
    carries = _projection("llama").trace.carries
    assert carries[2] == ((1, 0),) and carries[5] == ((4, 0),)
    assert carries[3] == () and carries[6] == ()


def test_fingerprint_is_the_same_at_every_granularity():
    model = build_hf_model(tiny_config("llama"))
    assert discover_blocks(model).fingerprint == discover_blocks(
        model, granularity="projection").fingerprint


@pytest.mark.parametrize("model_type,num_blocks,note", [
    ("gemma3_text", 19, ""), ("gpt2", 19, ""), ("mixtral", 15, "not floating point"),
    ("olmo2", 11, "made inside"), ("gpt_neox", 7, "stay whole")])
def test_families_split_where_exact(model_type, num_blocks, note):
    chain = _projection(model_type)
    assert len(chain.blocks) == num_blocks, chain.notes
    assert (note in " ".join(chain.notes)) if note else not chain.notes


def test_gemma3_post_norm_goes_with_the_projection():
    chain = _projection("gemma3_text")
    assert chain.blocks[2].modules == ("model.layers.0.self_attn.o_proj",
                                       "model.layers.0.post_attention_layernorm")


@pytest.fixture(scope="module")
def profiles():
    model = build_hf_model(tiny_config("llama"))
    return {g: profile_model(model, backend="analytical:h100", seq_len=16, granularity=g)
            for g in ("layer", "half", "projection")}


def test_cut_before_a_projection_counts_both_crossing_values(profiles):
    """fp32, 16 tokens: hidden 32 -> 2048 bytes; intermediate 64 -> 4096 bytes."""
    blocks = profiles["projection"].blocks
    assert [b.output_bytes for b in blocks[1:5]] == [2048 + 2048, 2048, 4096 + 2048, 2048]


def test_parts_sum_to_the_halves(profiles):
    """The part before the projection is the half less the projection: times, parameters
    and saved activations add up to the half profile's halves."""
    fused = coarsen(profiles["projection"], "half")
    halves = profiles["half"]
    assert fused.setup.granularity == "half"
    assert [b.name for b in fused.blocks] == [b.name for b in halves.blocks]
    for a, b in zip(fused.blocks, halves.blocks):
        assert a.param_bytes == b.param_bytes and a.modules == b.modules, (a.name, b.name)
        assert a.fwd_ms == pytest.approx(b.fwd_ms, rel=1e-9, abs=1e-12)
        assert a.bwd_ms == pytest.approx(b.bwd_ms, rel=1e-9, abs=1e-12)
        assert a.activation_bytes == b.activation_bytes
        assert a.held_for_weight_bytes == b.held_for_weight_bytes
        assert a.parts == b.parts and a.kind == b.kind
    layers = coarsen(profiles["projection"], "layer")
    assert [b.name for b in layers.blocks] == [b.name for b in profiles["layer"].blocks]
    assert [b.kind for b in layers.blocks] == [b.kind for b in profiles["layer"].blocks]


def test_plans_cut_inside_halves_and_keep_the_granularity(profiles):
    plan = make_plan(profiles["projection"], pp_size=2, schedule="1f1b", num_microbatches=4,
                     granularity="projection", split_head=False)
    assert plan.granularity == "projection"
    names = {b.name for b in profiles["projection"].blocks}
    assert {m for s in plan.stages for m in s.modules} == names
    halves = make_plan(profiles["projection"], pp_size=2, schedule="1f1b", num_microbatches=4,
                       granularity="half", split_head=False)
    assert halves.granularity == "half"
    assert {m for s in halves.stages for m in s.modules} == {
        b.name for b in profiles["half"].blocks}


@pytest.mark.slow
def test_cpu_measured_parts_sum_to_the_halves():
    """Measured on the CPU (saved-tensor hooks, deterministic): the parts' saved
    activations and parameters add up to the halves', and the cut before a projection
    sends its input and the residual (fp32, 16 tokens)."""
    model = build_hf_model(tiny_config("llama"))
    projection, halves = (profile_model(model, backend="cpu", seq_len=16, num_warmup=0,
                                        num_repeats=1, granularity=g)
                          for g in ("projection", "half"))
    assert [b.output_bytes for b in projection.blocks[1:5]] == [4096, 2048, 6144, 2048]
    for a, b in zip(coarsen(projection, "half").blocks, halves.blocks):
        assert (a.name, a.param_bytes, a.activation_bytes) == (
            b.name, b.param_bytes, b.activation_bytes)

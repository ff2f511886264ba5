"""A profile says which halves can be cut inside their call (``ModelInfo.slice_units``).

The check runs the first attention and MLP module whole and as two slices on the
forward's own arguments: numerically on cpu, by shapes on meta. Llama's halves pass;
OLMo-2's attention (q/k norms over all heads) is refused with the reason in a note;
a ``layer`` profile offers nothing.
"""

from __future__ import annotations

from families import tiny_config

from autopart.intake.sources import build_hf_model
from autopart.profile import profile_model

FAST = {"backend": "cpu", "seq_len": 8, "num_warmup": 1, "num_repeats": 2}


def test_cpu_profile_checks_and_offers_llama_halves():
    profile = profile_model(build_hf_model(tiny_config("llama")), granularity="half", **FAST)
    assert profile.model.slice_units == {"attention": 2, "mlp": 64}
    assert profile.model.slice_modules == {"attention": "self_attn", "mlp": "mlp"}
    again = type(profile).from_json(profile.to_json())
    assert again.model.slice_units == profile.model.slice_units


def test_a_refused_kind_is_named_in_a_note_and_layer_profiles_offer_none():
    profile = profile_model(build_hf_model(tiny_config("olmo2")), backend="analytical:h100",
                            seq_len=8)
    assert profile.model.slice_units == {"mlp": 64}
    assert any(n.startswith("attention halves cannot be sliced: Olmo2Attention")
               for n in profile.model.notes)
    layer = profile_model(build_hf_model(tiny_config("llama")), backend="analytical:h100",
                          seq_len=8, granularity="layer")
    assert layer.model.slice_units == {}

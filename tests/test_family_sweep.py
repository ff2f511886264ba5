"""The family sweep's shrink rule and the one-line refusal of non-causal types."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoConfig

from autopart.errors import ModelSourceError
from autopart.intake.sources import build_hf_model

_SPEC = importlib.util.spec_from_file_location(
    "family_sweep", Path(__file__).resolve().parent.parent / "scripts" / "family_sweep.py")
family_sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(family_sweep)


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss", "deepseek_v3", "qwen3_next",
                                        "mixtral", "gpt2"])
def test_one_rule_shrinks_to_a_tiny_model(model_type):
    """Default configs of very different families become models of under 1M parameters."""
    model = build_hf_model(family_sweep.shrink(model_type))
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.config.vocab_size == 96


@pytest.mark.parametrize(("model_type", "words"), [("t5", "encoder-decoder"),
                                                   ("distilbert", "no causal LM")])
def test_non_causal_types_are_refused_in_one_line(model_type, words):
    """Encoder-decoder and encoder-only types: one line naming why, no traceback text."""
    with pytest.raises(ModelSourceError) as info:
        build_hf_model(AutoConfig.for_model(model_type))
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["bert", "roberta", "electra"])
def test_encoders_are_refused_unless_they_are_decoders(model_type):
    """An encoder's causal-LM head attends both ways unless ``is_decoder`` is on: one line
    naming why; with ``is_decoder=True`` the same type builds."""
    with pytest.raises(ModelSourceError) as info:
        build_hf_model(family_sweep.shrink(model_type))
    assert "is an encoder" in str(info.value) and "is_decoder=True" in str(info.value)
    assert "\n" not in str(info.value)
    assert build_hf_model(family_sweep.shrink(model_type, {"is_decoder": True})) is not None


def test_the_rule_keeps_every_layer_kind_of_a_hybrid_stack():
    """A hybrid stack whose first attention layer comes late keeps one in 4 layers (Kimi
    Linear, Zamba2), a layer kind every 8 layers comes every 2 (Jamba), an MLA config's
    key-value heads match its query heads and group-limited routing fits 4 experts."""
    kimi = family_sweep.shrink("kimi_linear")
    assert set(kimi.layer_types) == {"linear_attention", "full_attention"}
    assert len(kimi.layer_types) == kimi.num_hidden_layers == 4
    assert set(family_sweep.shrink("zamba2").layers_block_type) == {"linear_attention", "hybrid"}
    jamba = family_sweep.shrink("jamba")
    assert jamba.attn_layer_period == 2 and 0 <= jamba.attn_layer_offset < 2
    axk1 = family_sweep.shrink("axk1")
    assert axk1.num_key_value_heads == axk1.num_attention_heads
    assert axk1.qk_head_dim == axk1.qk_nope_head_dim + axk1.qk_rope_head_dim
    assert axk1.n_group == 1 and axk1.topk_group == 1


def test_the_rule_uses_a_config_s_own_key_names():
    """XLM names its width ``emb_dim`` and its vocabulary ``n_words``: they shrink too."""
    config = family_sweep.shrink("xlm")
    assert config.emb_dim == 64 and config.n_words == 96 and config.n_layers == 4

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

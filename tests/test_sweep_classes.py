"""Classes of failure the family sweep found, each fixed in autopart (issue 21).

Each test builds a model of the class from its transformers default shrunk by the sweep's
rule, or a small module that shows the class alone.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from families import init_real
from runtime_helpers import max_grad_diffs
from torch import nn

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.intake.storage import empty_on, init_hf_weights, params_on_meta

_SPEC = importlib.util.spec_from_file_location(
    "family_sweep", Path(__file__).resolve().parent.parent / "scripts" / "family_sweep.py")
family_sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(family_sweep)


class _Slope(nn.Module):
    """A parameter whose value only its constructor sets (like Apertus' xIELU slopes)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([0.8]))
        self.weight = nn.Parameter(torch.empty(3, 3))
        nn.init.normal_(self.weight)  # set on the fly: a no-op once on meta


def test_constructor_values_of_small_parameters_survive_meta():
    """A small parameter built on meta starts from its constructor's value on a device."""
    with params_on_meta():
        module = _Slope()
    assert module.alpha.is_meta and module.weight.is_meta
    empty_on(module, "cpu", fill=float("nan"))
    assert module.alpha.item() == pytest.approx(0.8)
    assert torch.isnan(module.weight).all()


def test_parameters_no_init_weights_sets_get_a_default():
    """GPT-1's Conv1D weights are set inside the constructor only: after the model's own
    initialization they hold N(0, 0.02) and biases zeros, not uninitialized memory."""
    model = build_hf_model(family_sweep.shrink("openai-gpt"))
    empty_on(model, "cpu", fill=float("nan"))
    torch.manual_seed(0)
    with torch.no_grad():
        unset = init_hf_weights(model, model)
    assert "transformer.h.0.attn.c_attn.weight" in unset
    weight = model.transformer.h[0].attn.c_attn.weight
    assert torch.isfinite(weight).all() and 0.01 < weight.std().item() < 0.03
    assert not model.transformer.h[0].attn.c_attn.bias.any()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("model_type", ["openai-gpt", "xlnet"])
def test_registered_causal_lms_without_layer_names_are_hf_causal_lms(model_type):
    """transformers' causal LMs that name no ``_no_split_modules`` still take the HF path
    (built-in loss, labels), not the generic traced one that needs a loss_fn."""
    model = build_hf_model(family_sweep.shrink(model_type))
    assert not model._no_split_modules
    assert discover_blocks(model).family == "hf_causal_lm"


def test_unlimited_positions_do_not_refuse_a_sequence_length():
    """XLNet's ``max_position_embeddings`` is -1 (no limit): profiling at any length runs."""
    from autopart.profile import profile_model

    profile = profile_model(build_hf_model(family_sweep.shrink("xlnet")), backend="cpu",
                            seq_len=8, num_warmup=0, num_repeats=1, granularity="layer")
    assert profile.blocks


def test_no_gradient_in_either_model_matches():
    """The exactness helper: a parameter neither model gives a gradient (an indexer that
    only selects positions) matches; one that only one model gives a gradient does not."""
    used, unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    used.grad = torch.ones(2)
    diffs = max_grad_diffs([("used", used), ("unused", unused)], {"used": torch.ones(2)})
    assert diffs == {"used": 0.0, "unused": 0.0}
    diffs = max_grad_diffs([("used", used), ("unused", unused)], {"unused": torch.ones(2)})
    assert diffs["used"] == float("inf") and diffs["unused"] == float("inf")


def test_init_real_leaves_no_parameter_unset():
    """The tests' reference models (``families.init_real``) use the same initialization:
    Apertus' xIELU slopes hold the values its constructor gives them on the CPU."""
    from transformers.activations import XIELUActivation

    torch.manual_seed(0)
    model = init_real(build_hf_model(family_sweep.shrink("apertus")))
    act, fresh = model.model.layers[0].mlp.act_fn, XIELUActivation()
    assert act.alpha_p.item() == pytest.approx(fresh.alpha_p.item(), rel=1e-2)  # bf16 there
    assert act.alpha_n.item() == pytest.approx(fresh.alpha_n.item(), rel=1e-2)


def test_a_half_reading_a_child_weight_itself_stays_whole():
    """LFM3's short convolution hands ``conv.weight`` to a kernel function instead of
    calling the module: at the projection level its halves stay whole (a note says why)
    instead of the whole model being refused."""
    model = build_hf_model(family_sweep.shrink("lfm3"))
    chain = discover_blocks(model, granularity="projection")
    assert chain.granularity == "half"
    assert any("halves stay whole" in note and "outside its blocks" in note
               for note in chain.notes)


def test_each_sub_module_is_initialized_by_its_innermost_hf_model():
    """Gemma 3n's ``_init_weights`` reads ``hidden_size``, which only its inner text model
    has: initializing the causal LM goes through that model for its sub-modules."""
    model = build_hf_model(family_sweep.shrink("gemma3n_text"))
    empty_on(model, "cpu", fill=float("nan"))
    torch.manual_seed(0)
    with torch.no_grad():
        init_hf_weights(model, model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("model_type", ["jetmoe", "longcat_flash"])
def test_blocks_meta_cannot_run_are_watched_on_a_real_copy(model_type):
    """JetMoE's attention experts read their token counts with ``tolist`` and LongCat's
    router calls ``nonzero``: meta cannot run them, so a stand-in runs a small real copy
    of the block and the model is split like any other."""
    chain = discover_blocks(build_hf_model(family_sweep.shrink(model_type)))
    assert sum(1 for b in chain.blocks if b.kind == "decoder_layer") == 4


@pytest.mark.parametrize("model_type", ["zaya", "hrm_text"])
def test_a_parameter_glue_code_reads_is_named_in_one_line(model_type):
    """ZAYA scales its embeddings by a parameter of the model itself and HRM starts its
    recurrence from one: one line says a parameter is used outside the blocks, not that
    the forward failed on meta."""
    from autopart.errors import ModelSourceError

    with pytest.raises(ModelSourceError, match="uses a parameter of shape .* outside its "
                                               "blocks") as info:
        discover_blocks(build_hf_model(family_sweep.shrink(model_type)))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("model_type", "shifted"), [("llama", True), ("gpt2", True),
                                                     ("cpmant", False), ("xlnet", False),
                                                     ("trocr", False)])
def test_the_built_in_loss_shifts_labels_as_the_model_does(model_type, shifted):
    """CPM-Ant, XLNet and TrOCR apply cross entropy to their labels as given: the built-in loss
    of their pipelines does not shift them (as for every other causal LM it does)."""
    from autopart.runtime.builder import split_loss

    model = build_hf_model(family_sweep.shrink(model_type))
    builtin, custom = split_loss(None, discover_blocks(model, granularity="layer"), model)
    assert custom is None and builtin.shift_labels is shifted

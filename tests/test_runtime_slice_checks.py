"""A plan cutting halves into slices is checked before any collective, and each stage
computes the units its slices name.

Single process, models on meta: ``check_half_slices`` refuses malformed or impossible
slices in one line; ``stage_partials`` gives the hand-worked unit ranges of tiny Llama
(intermediate size 64, 2 KV heads).
"""

from __future__ import annotations

import dataclasses

import pytest
from families import tiny_config
from runtime_helpers import make_stage_plan

from autopart.errors import RuntimeSetupError
from autopart.intake import discover_blocks
from autopart.intake.blocks import with_carries
from autopart.intake.half_slices import slice_names
from autopart.intake.sources import build_hf_model
from autopart.runtime.slices import stage_partials
from autopart.runtime.validate import check_half_slices, check_plan

MLP = "model.layers.0.mlp"
ATTN = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def llama():
    model = build_hf_model(tiny_config("llama"))
    return model, with_carries(model, discover_blocks(model, granularity="sublayer"))


def _names(chain, sliced: dict[str, list[str]]) -> list[str]:
    return [s for name in chain.names for s in sliced.get(name, [name])]


def _plan(chain, names: list[str], counts: list[int] | None = None, **kwargs):
    counts = counts or [3, len(names) - 3]
    return make_stage_plan(chain, counts, schedule="1f1b", pp_size=2, num_microbatches=2,
                           names=names, granularity="sublayer", **kwargs)


def test_well_formed_slices_pass(llama):
    model, chain = llama
    names = _names(chain, {MLP: slice_names(MLP, 4), ATTN: slice_names(ATTN, 2)})
    plan = _plan(chain, names)
    check_plan(plan, chain, pp_size=2)
    check_half_slices(plan, chain, model)
    assert chain.trace.carries[chain.call_fqns.index(MLP) - 1] == ((3, 0),)  # the residual


@pytest.mark.parametrize(("slices", "match"), [
    ([f"{MLP}.slice0of4", f"{MLP}.slice2of4", f"{MLP}.slice3of4"], "expected .*slice0of4 .. "
     "slice3of4 once each, in order"),
    ([f"{MLP}.slice0of4", f"{MLP}.slice1of2"], r"lists slices \["),
    ([f"{MLP}.slice1of2", f"{MLP}.slice0of2"], r"slice0of2 .. slice1of2 once each, in order"),
])
def test_malformed_slices_are_refused(llama, slices, match):
    model, chain = llama
    with pytest.raises(RuntimeSetupError, match=match):
        check_half_slices(_plan(chain, _names(chain, {MLP: slices})), chain, model)


def test_slices_of_what_cannot_be_sliced_are_refused(llama):
    model, chain = llama
    norm = _names(chain, {"model.norm": slice_names("model.norm", 2)})
    with pytest.raises(RuntimeSetupError, match="model.norm into slices, but it is a norm "
                                                "block, not the module of a decoder-layer half"):
        check_half_slices(_plan(chain, norm), chain, model)
    too_many = _names(chain, {ATTN: slice_names(ATTN, 4)})
    with pytest.raises(RuntimeSetupError, match="into 4 slices but it has only 2 key/value "
                                                "heads"):
        check_half_slices(_plan(chain, too_many), chain, model)
    plan = dataclasses.replace(_plan(chain, _names(chain, {MLP: slice_names(MLP, 2)})),
                               tp_size=2)
    with pytest.raises(RuntimeSetupError, match="splits it over tp 2"):
        check_half_slices(plan, chain, model)


def test_a_cut_crossed_by_glue_values_is_refused(llama):
    model, chain = llama
    carries = list(chain.trace.carries)
    carries[chain.call_fqns.index(MLP) - 1] = None
    glued = dataclasses.replace(chain, trace=dataclasses.replace(chain.trace,
                                                                 carries=tuple(carries)))
    with pytest.raises(RuntimeSetupError, match=f"cuts inside {MLP}, but a value made by "
                                                f"the model's code"):
        check_half_slices(_plan(glued, _names(chain, {MLP: slice_names(MLP, 2)})), glued,
                          model)


def test_gpt2_attention_does_not_slice():
    model = build_hf_model(tiny_config("gpt2"))
    chain = with_carries(model, discover_blocks(model, granularity="sublayer"))
    half = "transformer.h.0.attn"
    plan = _plan(chain, _names(chain, {half: slice_names(half, 2)}))
    with pytest.raises(RuntimeSetupError, match="into slices, but GPT2Attention holds fewer "
                                                "than two nn.Linear projections"):
        check_half_slices(plan, chain, model)


def test_stage_partials_cover_their_slices_units(llama):
    model, chain = llama
    inside = stage_partials(model, chain, [f"{MLP}.slice1of4", f"{MLP}.slice2of4"])
    assert [(p.lo, p.hi, p.starts_inside, p.ends_inside) for p in inside] == [(16, 48, True,
                                                                              True)]
    across = stage_partials(model, chain, [f"{MLP}.slice3of4", ATTN + ".slice0of2"])
    assert [(p.call, p.lo, p.hi, p.starts_inside, p.ends_inside) for p in across] == [
        (4, 48, 64, True, False), (6, 0, 1, False, True)]
    whole = stage_partials(model, chain, ["model.embed_tokens", *slice_names(MLP, 2)])
    assert whole == []

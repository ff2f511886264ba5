"""A plan cutting halves into slices is checked before any collective, and each stage
computes the units its slices name.

Single process, models on meta: ``check_parts`` refuses malformed or impossible
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
from autopart.intake.sources import build_hf_model
from autopart.runtime.partials import stage_partials
from autopart.runtime.validate import check_parts, check_plan
from autopart.schema import Part
from autopart.schema.parts import derived_name

MLP = "model.layers.0.mlp"
ATTN = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def llama():
    model = build_hf_model(tiny_config("llama"))
    return model, with_carries(model, discover_blocks(model, granularity="half"))


def _units(module: str, *parts: tuple[int, int]) -> list[Part]:
    return [Part(module=module, axis="units", index=i, count=k) for i, k in parts]


def _every(module: str, count: int) -> list[Part]:
    return _units(module, *((i, count) for i in range(count)))


def _blocks(chain, cut: dict[str, list[Part]]):
    """The chain's blocks with the module of each key replaced by the parts listed."""
    out = []
    for block in chain.blocks:
        module = next((m for m in cut if m in block.fqns), None)
        if module is None:
            out.append((block.name, block.parts))
            continue
        out += [(derived_name(p.module, p.axis, p.index, p.count), (*block.parts, p))
                for p in cut[module]]
    return out


def _check(plan, chain, model):
    return check_parts(plan, chain, model, has_loss_fn=False)


def _plan(chain, blocks, counts: list[int] | None = None, **kwargs):
    counts = counts or [3, len(blocks) - 3]
    return make_stage_plan(chain, counts, schedule="1f1b", pp_size=2, num_microbatches=2,
                           blocks=blocks, **kwargs)


def test_well_formed_slices_pass(llama):
    model, chain = llama
    plan = _plan(chain, _blocks(chain, {MLP: _every(MLP, 4), ATTN: _every(ATTN, 2)}))
    check_plan(plan, chain, pp_size=2)
    assert [d.name for d in _check(plan, chain, model)][:2] == [f"{MLP}.slice0of4",
                                                                  f"{MLP}.slice1of4"]
    assert chain.trace.carries[chain.call_fqns.index(MLP) - 1] == ((3, 0),)  # the residual


@pytest.mark.parametrize("slices", [
    _units(MLP, (0, 4), (2, 4), (3, 4)), _units(MLP, (0, 4), (1, 2)),
    _units(MLP, (1, 2), (0, 2))])
def test_malformed_slices_are_refused(llama, slices):
    model, chain = llama
    with pytest.raises(RuntimeSetupError, match=r"lists parts \[.*; expected parts 0 .. "):
        _check(_plan(chain, _blocks(chain, {MLP: slices})), chain, model)


def test_slices_of_what_cannot_be_sliced_are_refused(llama):
    model, chain = llama
    norm = _blocks(chain, {"model.norm": _every("model.norm", 2)})
    with pytest.raises(RuntimeSetupError, match="model.norm into slices, but it is a norm "
                                                "block, not the module of a decoder-layer half"):
        _check(_plan(chain, norm), chain, model)
    too_many = _blocks(chain, {ATTN: _every(ATTN, 4)})
    with pytest.raises(RuntimeSetupError, match="into 4 slices but it has only 2 key/value "
                                                "heads"):
        _check(_plan(chain, too_many), chain, model)
    plan = dataclasses.replace(_plan(chain, _blocks(chain, {MLP: _every(MLP, 2)})), tp_size=2)
    with pytest.raises(RuntimeSetupError, match="shards it over tp 2"):
        _check(plan, chain, model)
    stray = _blocks(chain, {"model.norm": [Part(module="model.gone", axis="units", index=i,
                                                 count=2) for i in range(2)]})
    with pytest.raises(RuntimeSetupError, match="cuts model.gone along units, but no block"):
        _check(_plan(chain, stray), chain, model)


def test_a_cut_crossed_by_glue_values_is_refused(llama):
    model, chain = llama
    carries = list(chain.trace.carries)
    carries[chain.call_fqns.index(MLP) - 1] = None
    glued = dataclasses.replace(chain, trace=dataclasses.replace(chain.trace,
                                                                 carries=tuple(carries)))
    with pytest.raises(RuntimeSetupError, match=f"cuts inside {MLP}, but a value made by "
                                                f"the model's code"):
        _check(_plan(glued, _blocks(chain, {MLP: _every(MLP, 2)})), glued, model)


def test_gpt2_attention_does_not_slice():
    model = build_hf_model(tiny_config("gpt2"))
    chain = with_carries(model, discover_blocks(model, granularity="half"))
    half = "transformer.h.0.attn"
    plan = _plan(chain, _blocks(chain, {half: _every(half, 2)}))
    with pytest.raises(RuntimeSetupError, match="into slices, but GPT2Attention holds fewer "
                                                "than two nn.Linear projections"):
        _check(plan, chain, model)


def test_stage_partials_cover_their_slices_units(llama):
    model, chain = llama
    inside = stage_partials(model, chain, _units(MLP, (1, 4), (2, 4)))
    assert [(p.lo, p.hi, p.starts_inside, p.ends_inside) for p in inside] == [(16, 48, True,
                                                                              True)]
    across = stage_partials(model, chain, [*_units(MLP, (3, 4)), *_units(ATTN, (0, 2))])
    assert [(p.call, p.lo, p.hi, p.starts_inside, p.ends_inside) for p in across] == [
        (4, 48, 64, True, False), (6, 0, 1, False, True)]
    whole = stage_partials(model, chain, _every(MLP, 2))
    assert whole == []

"""Half slices: names, the structural rule, and the sum of slices against the whole module.

For each family's tiny config the attention and MLP modules of layer 0 are run on the
arguments the model's own forward gives them (fp32): split at every unit boundary,
the partial outputs must add up to the module's output, and their gradients to the
whole module's, within 1e-5. Families whose halves do not split that way are refused
by the rule (packed projections, norms over all heads) or by the check (StableLM's
attention reshapes by its configured head count).
"""

from __future__ import annotations

import pytest
import torch
from families import real_model, tiny_config

from autopart.intake.slice_rules import (
    add_outputs,
    check_slices,
    main_output,
    partial_forward,
    slice_rule,
    unit_range,
)
from autopart.schema import Part
from autopart.schema.parts import derived_name
from autopart.solve.cuts import parse_derived

TOL = 1e-5


def test_slice_names_and_parts():
    """A slice's name is for people; its part is typed data, checked when made."""
    assert derived_name("model.layers.3.mlp", "units", 1, 4) == "model.layers.3.mlp.slice1of4"
    assert parse_derived("model.layers.3.mlp.slice1of4") == ("model.layers.3.mlp", "units",
                                                             1, 4)
    assert parse_derived("model.layers.3.mlp") is None
    for index, count in ((4, 4), (0, 1), (-1, 2)):
        with pytest.raises(ValueError, match="expected count >= 2"):
            Part(module="model.layers.3.mlp", axis="units", index=index, count=count)
    with pytest.raises(ValueError, match="axis 'rows'"):
        Part(module="lm_head", axis="rows", index=0, count=2)
    assert [unit_range(i, 3, 8) for i in range(3)] == [(0, 2), (2, 5), (5, 8)]


def _calls(model_type: str):
    """Layer 0's attention and MLP modules with the arguments the forward gave them."""
    if model_type == "stablelm":  # not among the served families' tiny configs
        from transformers import AutoConfig

        config = AutoConfig.for_model("stablelm", vocab_size=96, hidden_size=32,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=64,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    else:
        config = tiny_config(model_type)
    model = real_model(config)
    layer = model.model.layers[0]
    seen = {}

    def keep(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, (module, args, kwargs))
        return hook

    hooks = [getattr(layer, name).register_forward_pre_hook(keep(name), with_kwargs=True)
             for name in ("self_attn", "mlp")]
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        model(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize(("model_type", "name"), [
    *((m, h) for m in ("llama", "qwen2", "qwen3", "gemma", "mistral")
      for h in ("self_attn", "mlp")),
    ("phi3", "mlp"),  # a fused gate_up_proj: each slice takes its rows from both blocks
])
def test_every_split_sums_to_the_module_with_its_gradients(model_type, name):
    module, args, kwargs = _calls(model_type)[name]
    rule, why = slice_rule(module)
    assert rule is not None, why
    assert rule.kind == ("attention" if name == "self_attn" else "mlp")
    if model_type == "phi3":
        assert rule.blocks == (("gate_up_proj.weight", 2),)
    assert check_slices(module, rule, args, kwargs) == ""
    x = args[0] if args else kwargs["hidden_states"]
    weight = torch.linspace(-1, 1, x.numel()).view_as(x)

    def run(bounds):
        module.zero_grad()
        inp = x.detach().clone().requires_grad_()
        a, kw = ((inp, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": inp})
        out = None
        for lo, hi in bounds:
            part = partial_forward(module, rule, lo, hi, a, kw)
            out = part if out is None else add_outputs(out, part)
        out = main_output(out)
        (out * weight).sum().backward()
        return out.detach(), inp.grad, {n: p.grad.clone() for n, p in
                                        module.named_parameters()}

    whole = run([(0, rule.units)])
    for cut in range(1, rule.units):
        got = run([(0, cut), (cut, rule.units)])
        assert (got[0] - whole[0]).abs().max() < TOL, (model_type, name, cut)
        assert (got[1] - whole[1]).abs().max() < TOL
        for key, grad in whole[2].items():
            assert (got[2][key] - grad).abs().max() < TOL, (model_type, key, cut)


def test_a_fused_mlp_is_not_offered_from_shapes_alone():
    """On meta (analytical profiles) interleaved gate/up rows would pass a shape check and
    train wrong: a rule with stacked blocks needs the numeric check."""
    module, args, kwargs = _calls("phi3")["mlp"]
    rule, _ = slice_rule(module)
    meta = module.to("meta")
    assert "profile on cpu or cuda" in check_slices(meta, rule, (args[0].to("meta"),), kwargs)


def test_a_fused_mlp_taken_as_one_block_fails_the_check():
    """The check, not the rule, proves the blocks' layout: Phi-3's gate_up_proj cut as if
    it were one block of columns gives another module."""
    import dataclasses

    module, args, kwargs = _calls("phi3")["mlp"]
    rule, _ = slice_rule(module)
    assert check_slices(module, dataclasses.replace(rule, blocks=()), args, kwargs) != ""


@pytest.mark.parametrize(("model_type", "half", "why"), [
    ("olmo2", "self_attn", "neither projections nor per-head norms"),
    ("phi3", "self_attn", "do not all read the hidden size"),
])
def test_halves_that_do_not_split_are_refused_by_the_rule(model_type, half, why):
    module = _calls(model_type)[half][0]
    rule, reason = slice_rule(module)
    assert rule is None and why in reason


def test_a_module_that_reshapes_by_its_configured_heads_fails_the_check():
    module, args, kwargs = _calls("stablelm")["self_attn"]
    rule, _ = slice_rule(module)
    assert rule is not None and rule.kind == "attention"
    assert "fails on sliced weights" in check_slices(module, rule, args, kwargs)


def test_multi_head_attention_is_cut_by_heads_not_columns():
    """Attention with as many key/value heads as query heads (MHA) is a sum over heads,
    not over single columns: a column split inside a head (3 of 4 heads' columns, say)
    would not be the module. Found by the plan fuzz on Gemma-7B (16 heads of 256)."""
    module, args, kwargs = _calls_with("llama", num_key_value_heads=4)["self_attn"]
    rule, why = slice_rule(module)
    assert rule is not None and rule.kind == "attention" and rule.units == 4, why
    assert check_slices(module, rule, args, kwargs) == ""


def _calls_with(model_type: str, **overrides):
    """``_calls`` of a tiny config with ``overrides``."""
    config = tiny_config(model_type, **overrides)
    model = real_model(config)
    layer = model.model.layers[0]
    seen = {}
    def keep(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, (module, args, kwargs))
        return hook

    hooks = [getattr(layer, name).register_forward_pre_hook(keep(name), with_kwargs=True)
             for name in ("self_attn", "mlp")]
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (2, 6)), use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen

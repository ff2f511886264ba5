"""Slices of a module held whole hand autograd only their own gradient.

``partial_forward`` with plain views hands every parameter a full-size dense gradient on
every backward (zeros outside the slice); the runtime's views (``held_grads``) hand the
rows' gradient sparse and add the columns' in place, into one dense ``.grad`` per step.
Both must give the same gradients as plain views, over several microbatches and steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import real_model, tiny_config

from autopart.intake.slice_rules import partial_forward, slice_rule, unit_range
from autopart.runtime.held_grads import cols_of, rows_of


def _mlp_and_input():
    model = real_model(tiny_config("llama"))
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    return mlp, x


@pytest.mark.parametrize("set_to_none", [True, False])
def test_slices_hand_only_their_gradient_and_match_plain_views(set_to_none):
    mlp, x = _mlp_and_input()
    rule, why = slice_rule(mlp)
    assert rule is not None, why
    twin = copy.deepcopy(mlp)  # run on plain views
    handed: list[tuple[str, torch.layout, int]] = []
    for name, param in mlp.named_parameters():
        param.register_hook(lambda g, name=name: handed.append(
            (name, g.layout, g.coalesce().values().numel() if g.is_sparse else g.numel())))
    lo, hi = unit_range(1, 4, rule.units)
    for step in range(2):
        buffers = set()
        for mb in range(3):
            inp = x * (1 + mb + 10 * step)
            partial_forward(mlp, rule, lo, hi, (inp,), {}, rows=rows_of,
                            cols=cols_of).pow(2).sum().backward()
            partial_forward(twin, rule, lo, hi, (inp,), {}).pow(2).sum().backward()
            buffers.add(tuple(p.grad.data_ptr() for p in mlp.parameters()))
        assert len(buffers) == 1
        for (name, param), ref in zip(mlp.named_parameters(), twin.parameters(), strict=True):
            assert param.grad.layout == torch.strided
            torch.testing.assert_close(param.grad, ref.grad, atol=1e-5, rtol=1e-5,
                                       msg=name)
        mlp.zero_grad(set_to_none=set_to_none)
        twin.zero_grad(set_to_none=set_to_none)
    shapes = {n: p.shape for n, p in mlp.named_parameters()}
    rows = {n: (hi - lo) * per * shapes[n][1] for n, per in rule.rows}
    (cols,) = [n for n, _ in rule.cols]
    for name, layout, numel in handed:
        assert layout == torch.sparse_coo, name
        assert numel == (0 if name == cols else rows[name]), name
    assert len(handed) == 2 * 3 * len(shapes)


def test_under_no_grad_and_on_frozen_weights_they_are_plain_views():
    mlp, _ = _mlp_and_input()
    weight = mlp.down_proj.weight
    with torch.no_grad():
        assert rows_of(weight, 1, 3)._base is weight and cols_of(weight, 1, 3)._base is weight
    weight.requires_grad_(False)
    assert cols_of(weight, 1, 3).grad_fn is None and weight.grad is None

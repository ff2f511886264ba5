"""The sharded head loss against F.cross_entropy: loss, hidden and weight gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopart.intake.head_split import vocab_range
from autopart.runtime.head_shards import shard_carry, summed_loss, token_losses
from autopart.schema.parts import derived_name
from autopart.solve.cuts import parse_derived


def _reference(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias)[:, :-1].reshape(-1, weight.shape[0]).float()
    return F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100,
                           reduction="sum")


def _sharded(hidden, weight, bias, labels, num_shards):
    carry = None
    for i in range(num_shards):
        carry = shard_carry(hidden, weight, bias, vocab_range(i, num_shards, weight.shape[0]),
                            labels[:, 1:], carry)
    return summed_loss(token_losses(carry), labels[:, 1:])


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sharded_loss_and_grads_match_cross_entropy(num_shards, with_bias):
    """Loss and the gradients of hidden, weight and bias equal F.cross_entropy's (sum)."""
    gen = torch.Generator().manual_seed(num_shards)
    hidden = torch.randn(3, 9, 16, generator=gen, requires_grad=True)
    weight = (torch.randn(50, 16, generator=gen) * 3).requires_grad_()
    bias = torch.randn(50, generator=gen, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 50, (3, 9), generator=gen)
    labels[0, 5:] = -100  # padding
    labels[2, 3] = -100
    params = [hidden, weight] + ([bias] if with_bias else [])
    want = _reference(hidden, weight, bias, labels)
    want_grads = torch.autograd.grad(want, params)
    got = _sharded(hidden, weight, bias, labels, num_shards)
    got_grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.to_dense(), w, atol=1e-5, rtol=1e-5)


def test_large_logits_do_not_overflow():
    """Logits near 1e4 (exp overflows in float32) still give the exact loss."""
    hidden = torch.full((1, 3, 2), 100.0)
    weight = torch.tensor([[50.0, 50.0], [49.0, 50.0], [0.0, 1.0], [50.0, 49.5]])
    labels = torch.tensor([[0, 1, 3]])
    torch.testing.assert_close(_sharded(hidden, weight, None, labels, 4),
                               _reference(hidden, weight, None, labels))


def test_shard_names_round_trip():
    """A vocabulary part's name, and a cut name read back from it; ranges tile the
    vocabulary."""
    names = [derived_name("lm_head", "vocab", i, 3) for i in range(3)]
    assert names == ["lm_head.shard0of3", "lm_head.shard1of3", "lm_head.shard2of3"]
    assert parse_derived("lm_head.shard1of3") == ("lm_head", "vocab", 1, 3)
    assert parse_derived("model.layers.0.mlp.slice2of4") == ("model.layers.0.mlp", "units",
                                                             2, 4)
    assert parse_derived("lm_head") is None
    assert [vocab_range(i, 3, 10) for i in range(3)] == [(0, 3), (3, 6), (6, 10)]



def _microbatch(weight, seed, tied):
    """(hidden, labels) of one random microbatch; with ``tied`` the hidden states are an
    embedding lookup of the same ``weight`` (embedding and head on one rank)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, weight.shape[0], (2, 7), generator=gen)
    raw = F.embedding(ids, weight) if tied else torch.randn(2, 7, weight.shape[1],
                                                             generator=gen)
    return raw.tanh(), ids


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_each_shard_hands_the_weight_only_its_rows(set_to_none, tied):
    """Two steps of three microbatches, 3 shards of a 50 x 16 head: every gradient a shard
    hands the weight is sparse with exactly its rows' values (indexing ``weight[lo:hi]``
    handed a dense 50 x 16 one: zeros outside the rows; tied, autograd adds them into
    the embedding lookup's dense gradient), each step accumulates into one
    dense ``.grad`` (created on the first forward when None), and it equals
    F.cross_entropy's accumulated gradient, with the weight tied to an embedding or not."""
    weight = torch.randn(50, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    plain = weight.detach().clone().requires_grad_()
    handed = []
    weight.register_hook(lambda g: handed.append(
        (g.layout, g.coalesce().values().numel() if g.is_sparse else g.numel())))
    for step in range(2):
        buffers = set()
        for mb in range(3):
            hidden, ids = _microbatch(weight, 10 * step + mb, tied)
            _sharded(hidden, weight, None, ids, 3).backward()
            buffers.add((weight.grad.data_ptr(), weight.grad.layout))
            hidden, ids = _microbatch(plain, 10 * step + mb, tied)
            _reference(hidden, plain, None, ids).backward()
        assert len(buffers) == 1 and next(iter(buffers))[1] == torch.strided
        torch.testing.assert_close(weight.grad, plain.grad, atol=1e-5, rtol=1e-5)
        for p in (weight, plain):
            torch.optim.SGD([p], lr=0.0).zero_grad(set_to_none=set_to_none)
    # one backward of all three shards: their rows summed sparse; tied, added into the
    # embedding lookup's dense gradient
    assert handed == [(torch.strided if tied else torch.sparse_coo, 50 * 16)] * 6
    handed.clear()
    hidden, ids = _microbatch(weight, 99, False)
    token_losses(shard_carry(hidden, weight, None, (10, 20), ids[:, 1:])).sum().backward()
    assert handed == [(torch.sparse_coo, 10 * 16)]

"""Pruned model trees keep original FQNs; materialization touches only the held blocks."""

from __future__ import annotations

import torch
from torch import nn

from autopart.intake import load_model
from autopart.runtime.materialize import materialize_blocks
from autopart.runtime.tree import prune


def test_prune_keeps_fqns_and_layer_count():
    model = load_model("tiny-llama").model
    tree = prune(model, ["model.layers.2", "model.layers.3", "model.norm", "lm_head"])
    names = {n for n, _ in tree.named_parameters()}
    assert {"model.layers.2.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight",
            "model.norm.weight", "lm_head.weight"} <= names
    assert not any(n.startswith(("model.layers.0", "model.embed_tokens")) for n in names)
    assert len(tree.model.layers) == 4 and tree.model.layers[3] is model.model.layers[3]
    assert set(tree.state_dict()) <= set(model.state_dict())


def test_materialize_only_held_blocks_and_seeded_by_position():
    """Blocks get the same values whatever other blocks a rank holds; others stay on meta."""
    with torch.device("meta"):
        first = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        second = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    common = {"device": torch.device("cpu"), "dtype": None, "param_init_fn": None,
              "checkpoint_path": None, "init_seed": 3, "aliases": {}}
    materialize_blocks(first, [(1, "1")], **common)
    materialize_blocks(second, [(0, "0"), (1, "1")], **common)
    assert first[0].weight.is_meta and first[2].weight.is_meta
    assert not first[1].weight.is_meta
    assert torch.equal(first[1].weight, second[1].weight)
    assert not torch.equal(second[0].weight, second[1].weight)


def test_initial_values_do_not_depend_on_the_granularity_or_the_block_numbering():
    """A layer materialized as one block or as its parts, at any chain position, gets the
    same values (each module seeded by its FQN): plans at different levels train alike."""
    common = {"device": torch.device("cpu"), "dtype": None, "param_init_fn": None,
              "checkpoint_path": None, "init_seed": 7, "aliases": {}}
    whole = load_model("tiny-llama").model
    parts = load_model("tiny-llama").model
    materialize_blocks(whole, [(2, "model.layers.1"), (3, "model.layers.2")], **common)
    materialize_blocks(parts, [(5, "model.layers.1.input_layernorm"),
                               (5, "model.layers.1.self_attn"),
                               (6, "model.layers.1.post_attention_layernorm"),
                               (7, "model.layers.1.mlp")], **common)
    got = dict(parts.model.layers[1].named_parameters())
    for name, value in whole.model.layers[1].named_parameters():
        assert torch.equal(value, got[name]), name
    one, two = whole.model.layers[1], whole.model.layers[2]
    assert not torch.equal(one.self_attn.q_proj.weight, two.self_attn.q_proj.weight)

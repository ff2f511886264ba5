"""The model's tp plan read and checked, and torch's TP applied to a block (one process).

Hand-written expectations: tiny-llama's ``base_model_tp_plan`` under the ``model.``
prefix, refusals with one line each, and a split layer on a one-rank mesh that
computes what the plain layer computes.
"""

from __future__ import annotations

import pytest
import torch
from families import tiny_config
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autopart.errors import RuntimeSetupError
from autopart.intake import load_model
from autopart.intake.sources import build_hf_model
from autopart.runtime.tensor_parallel import (
    _matches,
    apply_tensor_parallel,
    is_sharded,
    local_tensor,
    tp_plan_of,
)


def test_llama_plan_gets_the_base_model_prefix():
    plan = tp_plan_of(load_model("tiny-llama").model, 2)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert len(plan) == 7 and all(k.startswith("model.layers.*.") for k in plan)


def test_pattern_matches_whole_atoms_only():
    assert _matches("model.layers.12.mlp.up_proj", "model.layers.*.mlp.up_proj")
    assert not _matches("model.layers.1.mlp.up_proj.lora", "model.layers.*.mlp.up_proj")
    assert not _matches("model.layers.1.mlp", "model.layers.*.mlp.up_proj")


def test_refusals_name_the_problem():
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RuntimeSetupError, match="has no tensor-parallel plan"):
        tp_plan_of(plain, 2)
    with pytest.raises(RuntimeSetupError, match=r"tp_size 3 does not divide "
                                                 r"num_attention_heads \(4\)"):
        tp_plan_of(load_model("tiny-llama").model, 3)
    mixtral = build_hf_model(tiny_config("mixtral"))
    with pytest.raises(RuntimeSetupError, match=r"uses style\(s\) \['moe_tp_experts', "
                                                 r"'packed_colwise'\]"):
        tp_plan_of(mixtral, 2)


def test_qwen3_per_head_norms_are_summed_not_split():
    plan = tp_plan_of(build_hf_model(tiny_config("qwen3")), 2)
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"


def test_split_layers_compute_the_same_on_one_rank(one_rank):
    """A one-rank tp mesh: layers become DTensors, the output is a plain tensor, equal."""
    torch.manual_seed(0)
    block = nn.Module()
    block.up = nn.Linear(8, 16)
    block.down = nn.Linear(16, 8)
    block.norm = nn.LayerNorm(8)
    x = torch.randn(3, 8)
    expected = block.down(block.up(x))
    mesh = init_device_mesh("cpu", (1,))
    grad_sum = apply_tensor_parallel(block, {"up": "colwise", "down": "rowwise",
                                             "norm": "replicated_with_grad_allreduce"}, mesh)
    assert grad_sum == [block.norm.weight, block.norm.bias]
    assert isinstance(block.up.weight, DTensor) and is_sharded(block.up.weight)
    assert not is_sharded(block.down.bias) and not is_sharded(x)
    out = block.down(block.up(x))
    assert type(out) is torch.Tensor and torch.allclose(out, expected)
    assert local_tensor(block.up.weight).shape == (16, 8)


def test_only_linear_layers_are_split(one_rank):
    block = nn.Module()
    block.emb = nn.Embedding(4, 4)
    with pytest.raises(RuntimeSetupError, match=r"shards emb \(Embedding\) colwise"):
        apply_tensor_parallel(block, {"emb": "colwise"}, init_device_mesh("cpu", (1,)))

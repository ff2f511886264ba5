"""The model's tp plan read and checked, and torch's TP applied to a block (one process).

Hand-written expectations: tiny-llama's ``base_model_tp_plan`` under the ``model.``
prefix, refusals with one line each, a split layer and a whole model with its embedding
and head split by vocabulary and its norms sequence-parallel on a one-rank mesh that
compute what the plain ones compute, and the tp group's carry gather.
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


def test_sequence_parallel_refuses_gathering_styles_and_vocab_must_divide():
    """phi3's layers gather their outputs (colwise_gather_output): no sequence parallelism;
    a vocabulary tp does not divide cannot be split by it."""
    phi3 = build_hf_model(tiny_config("phi3"))
    assert tp_plan_of(phi3, 2)  # without sequence parallelism it maps
    with pytest.raises(RuntimeSetupError, match=r"--sequence-parallel off"):
        tp_plan_of(phi3, 2, sequence_parallel=True)
    with pytest.raises(RuntimeSetupError, match=r"tp_size 2 does not divide vocab_size \(97\)"):
        tp_plan_of(build_hf_model(tiny_config("llama", vocab_size=97)), 2)


def _tiny_block() -> nn.Module:
    torch.manual_seed(0)
    block = nn.Module()
    block.up = nn.Linear(8, 16)
    block.down = nn.Linear(16, 8)
    block.norm = nn.LayerNorm(8)
    return block


def test_split_layers_compute_the_same_on_one_rank(one_rank):
    """A one-rank tp mesh: layers become DTensors, the output is a plain tensor, equal."""
    block = _tiny_block()
    x = torch.randn(3, 8)
    expected = block.down(block.up(x))
    mesh = init_device_mesh("cpu", (1,))
    tp = apply_tensor_parallel(block, {"up": "colwise", "down": "rowwise",
                                       "norm": "replicated_with_grad_allreduce"}, mesh,
                               held=[], sequence_parallel=False, gather_logits=False)
    assert tp.grad_sum == [block.norm.weight, block.norm.bias] and tp.head_rows is None
    assert isinstance(block.up.weight, DTensor) and is_sharded(block.up.weight)
    assert not is_sharded(block.down.bias) and not is_sharded(x)
    out = block.down(block.up(x))
    assert type(out) is torch.Tensor and torch.allclose(out, expected)
    assert local_tensor(block.up.weight).shape == (16, 8)


def test_vocabulary_parallel_blocks_and_sequence_parallel_norms(one_rank):
    """tiny-llama's blocks on a one-rank mesh with sequence parallelism: the embedding and
    head are split by rows (the head's rows are the whole vocabulary here), the norms'
    parameters replicated DTensors, the attention and MLP take one replicated input, and
    the logits equal the plain model's."""
    from families import init_real

    from autopart.intake import discover_blocks

    model = init_real(build_hf_model(tiny_config("llama")))
    ids = torch.randint(0, 96, (2, 6))
    expected = model(input_ids=ids).logits
    held = list(discover_blocks(model).blocks)
    tp = apply_tensor_parallel(model, tp_plan_of(model, 1), init_device_mesh("cpu", (1,)),
                               held=held, sequence_parallel=True, gather_logits=False)
    assert tp.head_rows == (0, 96) and tp.sequence_parallel
    assert is_sharded(model.model.embed_tokens.weight) and is_sharded(model.lm_head.weight)
    norm = model.model.layers[0].input_layernorm.weight
    assert isinstance(norm, DTensor) and not is_sharded(norm)
    assert model.model.layers[0].self_attn._forward_pre_hooks
    torch.testing.assert_close(model(input_ids=ids).logits, expected)


def test_gather_carries_on_one_rank_is_the_carry(one_rank):
    """One rank holds the whole vocabulary: the gathered and folded carry is its own, and
    its gradient flows back unchanged."""
    import torch.distributed as dist

    from autopart.runtime.head_shards import gather_carries

    lse = torch.randn(2, 5, requires_grad=True)
    target = torch.randn(2, 5, requires_grad=True)
    out = gather_carries((lse, target), dist.group.WORLD)
    torch.testing.assert_close(out[0], lse)
    (out[0] * 2 + out[1] * 3).sum().backward()
    assert torch.equal(lse.grad, torch.full_like(lse, 2.0))
    assert torch.equal(target.grad, torch.full_like(target, 3.0))


def test_only_linear_layers_are_split(one_rank):
    block = nn.Module()
    block.emb = nn.Embedding(4, 4)
    with pytest.raises(RuntimeSetupError, match=r"shards emb \(Embedding\) colwise"):
        apply_tensor_parallel(block, {"emb": "colwise"}, init_device_mesh("cpu", (1,)),
                              held=[], sequence_parallel=False, gather_logits=False)

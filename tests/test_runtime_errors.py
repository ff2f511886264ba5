"""Bad input to auto_pipeline fails before any collective with one clear RuntimeSetupError.

Single process: a one-rank gloo group stands in for the world. Also checks that a
one-rank pipeline trains exactly like the unpipelined model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families import init_real
from runtime_helpers import make_stage_plan, max_grad_diffs, padded_batch
from torch import nn

from autopart.errors import RuntimeSetupError, SchemaError
from autopart.intake import discover_blocks, load_model
from autopart.runtime import auto_pipeline


def _plan(source: str = "tiny-llama", pp_size: int = 1, schedule: str = "gpipe"):
    chain = discover_blocks(load_model(source).model)
    counts = [7] if pp_size == 1 else [4, 3]
    return make_stage_plan(chain, counts, schedule=schedule, pp_size=pp_size, num_microbatches=2)


def test_needs_initialized_process_group():
    with pytest.raises(RuntimeSetupError, match="init_process_group"):
        auto_pipeline("tiny-llama", plan=_plan())


def test_world_size_mismatch(one_rank):
    with pytest.raises(RuntimeSetupError, match=r"needs pp 2 x dp 1 x tp 1 = 2 rank\(s\) but "
                                                 r"the world has 1; launch 2 ranks"):
        auto_pipeline("tiny-llama", plan=_plan(pp_size=2), device="cpu")
    tp2 = dataclasses.replace(_plan(), tp_size=2)  # tp_size written by hand
    with pytest.raises(RuntimeSetupError, match=r"pp 1 x dp 1 x tp 2 = 2 rank\(s\)"):
        auto_pipeline("tiny-llama", plan=tp2, device="cpu")
    with pytest.raises(RuntimeSetupError, match=r"tp_size 4 does not divide "
                                                 r"num_key_value_heads \(2\)"):
        auto_pipeline("tiny-llama", plan=dataclasses.replace(tp2, tp_size=4), device="cpu")


def test_plan_for_another_model(one_rank):
    with pytest.raises(RuntimeSetupError, match="made for another model"):
        auto_pipeline("tiny-llama-tied", plan=_plan("tiny-llama"), device="cpu")


def test_plan_modules_do_not_match(one_rank):
    plan = _plan()
    stage = dataclasses.replace(plan.stages[0], modules=plan.stages[0].modules[:-1])
    bad = dataclasses.replace(plan, stages=(stage,))
    with pytest.raises(RuntimeSetupError, match=r"leaves out blocks \['lm_head'\]"):
        auto_pipeline("tiny-llama", plan=bad, device="cpu")


def test_generic_model_needs_loss_fn(one_rank):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    plan = make_stage_plan(discover_blocks(model), [2], schedule="gpipe", pp_size=1,
                     num_microbatches=2)
    with pytest.raises(RuntimeSetupError, match="needs loss_fn"):
        auto_pipeline(model, plan=plan, device="cpu")


def test_bad_plan_path_and_options(one_rank, tmp_path):
    with pytest.raises(SchemaError, match="does not exist"):
        auto_pipeline("tiny-llama", plan=tmp_path / "missing.json", device="cpu")
    with pytest.raises(RuntimeSetupError, match="activation_checkpointing"):
        auto_pipeline("tiny-llama", plan=_plan(), device="cpu", activation_checkpointing="all")
    with pytest.raises(RuntimeSetupError, match="schedule zbv needs exactly 2 stage"):
        auto_pipeline("tiny-llama", plan=dataclasses.replace(_plan(), schedule="zbv"),
                      device="cpu")


def test_one_rank_pipeline_matches_unpipelined(one_rank):
    """pp=1 GPipe with 4 microbatches on a padded batch: loss and grads equal HF's."""
    model = load_model("tiny-llama").model
    torch.manual_seed(0)
    init_real(model)
    input_ids, mask, labels = padded_batch(512)
    ref = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    plan = dataclasses.replace(_plan(), num_microbatches=4)
    pipe = auto_pipeline("tiny-llama", plan=plan, device="cpu")
    pipe.load_state_dict(model.state_dict())
    loss = pipe.step(input_ids, target=labels, attention_mask=mask)
    assert abs(loss.item() - ref.item()) < 1e-5
    diffs = max_grad_diffs(pipe.named_parameters(), ref_grads)
    assert len(diffs) == len(ref_grads) and max(diffs.values()) < 1e-5
    assert pipe.is_first and pipe.is_last
    assert sum(pipe.stage_param_counts().values()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("plan_dtype", "model_dtype", "given", "expected"), [
    ("bfloat16", torch.float32, {}, torch.bfloat16),  # built fp32 from a config: narrowed
    ("float32", torch.bfloat16, {}, None),  # already narrower than its plan: kept
    ("float32", torch.float32, {}, None),
    ("bfloat16", torch.float32, {"autocast_dtype": torch.bfloat16}, None),
    ("bfloat16", torch.float32, {"dtype": torch.float16}, torch.float16),
])
def test_blocks_run_in_the_plans_dtype_where_it_is_narrower(plan_dtype, model_dtype, given,
                                                              expected):
    from types import SimpleNamespace

    from autopart.runtime.builder import _block_dtype
    from autopart.runtime.options import RuntimeOptions

    plan = SimpleNamespace(setup=SimpleNamespace(param_dtype=plan_dtype))
    assert _block_dtype(RuntimeOptions(**given), plan,
                        nn.Linear(2, 2, device="meta", dtype=model_dtype)) == expected

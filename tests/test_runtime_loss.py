"""``CausalLMLoss``: what ``target`` means, against F.cross_entropy and the unpipelined model.

Hand-checked in one process: the loss of one batch is HF's (labels shifted inside, -100
ignored), ``shift_labels=False`` takes targets aligned with the logits, a custom
``ignore_index`` is honoured, and the per-microbatch forms (whole logits, a head split by
vocabulary) add up to the whole batch's token mean. On 2 gloo ranks the loss object
passed as ``loss_fn`` trains exactly like the unpipelined model, with the head whole and
split across stages, shifted or aligned targets.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from runtime_helpers import make_stage_plan, max_grad_diffs, padded_batch, planned_blocks, run_ranks
from test_runtime_hf import ALIASES, TOL, _meta_model, reference

from autopart import CausalLMLoss
from autopart.errors import AutopartError
from autopart.intake import discover_blocks
from autopart.intake.head_split import vocab_range
from autopart.runtime.builder import split_loss
from autopart.runtime.head_shards import shard_carry, token_losses
from autopart.runtime.loss import LogitsLoss, TokenLossesLoss
from autopart.runtime.plan_source import AutoOptions
from autopart.solve import PlanOptions


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[0, 4:] = -100
    labels[2, :2] = -100
    return logits, labels


def _hf_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def test_shifted_target_is_hf_labels():
    """Default: the logits at t predict target[:, t + 1]; mean over the counted tokens."""
    logits, labels = _batch()
    torch.testing.assert_close(CausalLMLoss()(logits, labels), _hf_loss(logits, labels))
    assert CausalLMLoss().count(labels) == 14  # 3 + 6 + 5 positions after the shift count


def test_aligned_target_and_custom_ignore_index():
    """shift_labels=False: target[:, t] is what the logits at t predict (the last position's
    label counts too); ignore_index=0 leaves out the zeros instead of -100."""
    logits, labels = _batch()
    aligned = labels[:, 1:]
    loss = CausalLMLoss(shift_labels=False)
    torch.testing.assert_close(loss(logits[:, :-1], aligned), _hf_loss(logits, labels))
    zeros = labels.clamp(min=0)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 11), zeros[:, 1:].reshape(-1),
                           ignore_index=0)
    torch.testing.assert_close(CausalLMLoss(ignore_index=0)(logits, zeros), want)


def test_microbatch_forms_add_up_to_the_batch_mean():
    """Whole logits and a head split into 3 vocabulary shards: the microbatches' losses,
    each divided by the whole batch's token count, sum to the batch's token mean."""
    spec = CausalLMLoss()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 6, 5, generator=gen)
    weight = torch.randn(11, 5, generator=gen)
    labels = torch.randint(0, 11, (4, 6), generator=gen)
    labels[1, 3:] = -100
    aligned = spec.targets(labels)
    want = spec(F.linear(hidden, weight), labels)
    whole, split = LogitsLoss(spec), TokenLossesLoss(spec)
    whole.num_tokens = split.num_tokens = spec.count(labels)
    got_whole = got_split = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        got_whole += whole(F.linear(hidden[rows], weight), aligned[rows])
        carry = None
        for i in range(3):
            carry = shard_carry(hidden[rows], weight, None, vocab_range(i, 3, 11),
                                aligned[rows], carry)
        got_split += split(token_losses(carry), aligned[rows])
    torch.testing.assert_close(got_whole, want)
    torch.testing.assert_close(got_split, want)


def test_which_loss_runs_and_what_auto_plans():
    """The built-in loss is passed or the HF default; a custom callable keeps plan='auto'
    from cutting the head by vocabulary (every other level stays open), the built-in loss
    does not restrict it; pp and dp sizes come from the groups."""
    chain = discover_blocks(_meta_model("tiny-llama"))
    mine = CausalLMLoss(shift_labels=False)
    assert split_loss(mine, chain) == (mine, None)
    builtin, custom = split_loss(None, chain)
    assert isinstance(builtin, CausalLMLoss) and custom is None
    assert split_loss(F.mse_loss, chain) == (None, F.mse_loss)
    groups = SimpleNamespace(pp_size=2, dp_size=2)
    profile, plan = AutoOptions().resolved(groups, "cpu", custom_loss=True)
    assert (profile.backend, plan.pp_size, plan.dp_size, plan.split_head) == ("cpu", 2, 2, False)
    _, plan = AutoOptions({"granularity": "slice"}).resolved(groups, "cpu", custom_loss=True)
    assert (plan.granularity, plan.split_head) == ("slice", False)
    _, plan = AutoOptions(PlanOptions(pp_size=2, schedule="1f1b")).resolved(
        groups, "cuda", custom_loss=False)
    assert (plan.schedule, plan.split_head) == ("1f1b", None)
    with pytest.raises(AutopartError, match="unknown plan option 'seq_len'"):
        AutoOptions({"seq_len": 8}).resolved(groups, "cpu", custom_loss=False)


# name -> (schedule, head shards (0: whole), block counts per stage, shift_labels)
_CASES = {
    "whole-1f1b": ("1f1b", 0, [4, 3], True),
    "split-zbv-aligned": ("zbv", 2, [2, 2, 3, 1], False),
    "split-1f1b": ("1f1b", 3, [7, 2], True),
}


def _worker(rank: int, world_size: int) -> dict:
    from autopart.runtime import auto_pipeline

    batch = padded_batch(_meta_model("tiny-llama-tied").config.vocab_size, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference("tiny-llama-tied", batch)
    chain = discover_blocks(_meta_model("tiny-llama-tied"))
    input_ids, mask, labels = batch
    results = {"ref_loss": ref_loss}
    for name, (schedule, shards, counts, shift) in _CASES.items():
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=4, blocks=planned_blocks(chain, vocab=shards))
        pipe = auto_pipeline(_meta_model("tiny-llama-tied"), plan=plan, device="cpu",
                             loss_fn=CausalLMLoss(shift_labels=shift))
        pipe.load_state_dict(state)
        # aligned: the label of the position after each one, -100 after the last
        target = labels if shift else F.pad(labels[:, 1:], (0, 1), value=-100)
        loss = pipe.step(input_ids, target=target, attention_mask=mask)
        diffs = max_grad_diffs(pipe.named_parameters(), ref_grads, ALIASES)
        results[name] = {"loss": None if loss is None else loss.item(),
                         "max_grad_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get)}
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_builtin_loss_trains_exactly_whole_or_split(tmp_path):
    """loss_fn=CausalLMLoss(...) on tiny-llama-tied (padded batch): loss and every gradient
    within 1e-5 of LlamaForCausalLM's, head whole or split by vocabulary across stages,
    labels shifted inside or aligned by the caller."""
    results = run_ranks(_worker, 2, tmp_path)
    for name in _CASES:
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert len(losses) == 1 and abs(losses[0] - results[0]["ref_loss"]) < TOL, name
        for r in results:
            assert r[name]["max_grad_diff"] < TOL, (name, r[name])

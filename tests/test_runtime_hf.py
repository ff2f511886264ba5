"""Pipelined HF causal LMs on real gloo ranks vs the unpipelined model.

Every schedule, padded batches with an attention mask: the loss and every
parameter gradient must equal those of ``LlamaForCausalLM`` on the whole batch
(max abs diff < 1e-5 in fp32). Each rank compares its own parameters against a
reference it computes locally (the models are tiny).
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_plan, max_grad_diffs, padded_batch, run_ranks

from autopart.intake import discover_blocks, load_model
from autopart.runtime import auto_pipeline

pytestmark = pytest.mark.multiprocess

TOL = 1e-5

# schedule -> (block counts per stage for the 7 blocks of tiny-llama, microbatches), pp = 2
SCHEDULES_PP2 = {
    "gpipe": ([3, 4], 4),
    "1f1b": ([4, 3], 4),
    "interleaved-1f1b": ([2, 2, 1, 2], 4),
    "looped-bfs": ([1, 2, 2, 2], 4),
    "interleaved-zb": ([2, 1, 2, 2], 4),
    "zbv": ([2, 2, 2, 1], 4),
    "dualpipev": ([2, 1, 2, 2], 4),
}


def reference(source: str, batch: tuple[torch.Tensor, ...], seed: int = 0):
    """Real-weight model, its state dict, loss and gradients on the whole batch."""
    model = load_model(source).model
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights() if hasattr(model, "init_weights") else None
    from autopart.intake import init_rotary

    init_rotary(model, "cpu")
    input_ids, mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, out.loss.item(), grads


def _schedules_worker(rank: int, world_size: int, source: str, schedules: dict) -> dict:
    batch = padded_batch(512, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference(source, batch)
    chain = discover_blocks(load_model(source).model)
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    results = {}
    for name, (counts, num_mb) in schedules.items():
        plan = make_plan(chain, counts, schedule=name, pp_size=world_size,
                         num_microbatches=num_mb)
        pipe = auto_pipeline(source, plan=plan, device="cpu")
        pipe.load_state_dict(state)
        input_ids, mask, labels = batch
        loss = pipe.step(input_ids, target=labels, attention_mask=mask)
        diffs = max_grad_diffs(pipe.named_parameters(), ref_grads, aliases)
        results[name] = {"loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
                         "max_grad_diff": max(diffs.values()), "num_params": len(diffs),
                         "worst": max(diffs, key=diffs.get)}
    return results


def _check(results: list[dict], schedules: dict) -> None:
    for name in schedules:
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert losses, f"{name}: no rank returned a loss"
        for r in results:
            got = r[name]
            assert got["num_params"] > 0, name
            assert got["max_grad_diff"] < TOL, (name, got)
        for loss in losses:
            assert abs(loss - results[0][name]["ref_loss"]) < TOL, (name, loss)


@pytest.mark.timeout(240)
def test_every_schedule_matches_unpipelined_llama(tmp_path):
    """tiny-llama on 2 ranks, each schedule: loss and grads equal LlamaForCausalLM's."""
    results = run_ranks(_schedules_worker, 2, tmp_path, "tiny-llama", SCHEDULES_PP2)
    _check(results, SCHEDULES_PP2)

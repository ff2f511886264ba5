"""Tensor and data parallelism inside the pipeline, on 4 real gloo ranks, vs the unpipelined model.

pp 2 x tp 2: ``auto_pipeline`` builds the ``("pp", "dp", "tp")`` mesh from the plan,
splits tiny-llama's attention and MLP layers with torch's ``parallelize_module``
as its ``base_model_tp_plan`` says, and one training step must equal
``LlamaForCausalLM`` on the whole batch: the loss and every gradient, gathered
whole from its shards with ``full_tensor()``, within 1e-5; the global grad norm
of ``clip_grad_norm_`` equals the reference's (each shard counted once).
Qwen3's per-head ``q_norm``/``k_norm`` see only their rank's heads: their gradients
are summed over the tp group. Tied embeddings: the head's copy of the tied weight
(its own FQN, ``lm_head.weight``) is summed with the embedding's. pp 2 x dp 2: the
mesh comes from the plan too; each replica takes half the batch.

The plans' ``tp_size`` / ``dp_size`` are written by hand (``dataclasses.replace``)
on a contiguous plan: the planner's mesh search is not what is tested here.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from families import real_model, tiny_config
from runtime_helpers import make_stage_plan, padded_batch, run_ranks
from test_runtime_hf import ALIASES, _meta_model, reference
from torch.distributed.tensor import DTensor

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime import auto_pipeline, load_checkpoint, save_checkpoint
from autopart.runtime.tensor_parallel import is_sharded

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
# schedule -> block counts per stage for the 7 blocks of tiny-llama (pp 2, 4 microbatches)
TP_SCHEDULES = {"1f1b": [4, 3], "interleaved-zb": [2, 1, 2, 2], "zbv": [2, 2, 2, 1]}


def _compare(pipe, loss, ref_loss: float, ref_grads: dict) -> dict:
    """Loss, max |gathered grad - reference grad| and the shards this rank holds."""
    diffs, num_sharded = {}, 0
    for name, p in pipe.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        ref = ref_grads.get(name, ref_grads.get(ALIASES.get(name, ""), None))
        diffs[name] = (grad - ref).abs().max().item()
        if is_sharded(p):
            num_sharded += 1
            assert p.to_local().numel() * 2 == p.numel(), name
    return {"loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
            "max_grad_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get),
            "params": sorted(diffs), "num_sharded": num_sharded, "ref_params": sorted(ref_grads)}


def _tp_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    batch = padded_batch(512, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference("tiny-llama", batch)
    ref_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref_grads.values()))
    chain = discover_blocks(_meta_model("tiny-llama"))
    input_ids, mask, labels = batch
    results = {"ref_norm": ref_norm}
    for name, counts in TP_SCHEDULES.items():
        plan = make_stage_plan(chain, counts, schedule=name, pp_size=2, num_microbatches=4)
        pipe = auto_pipeline(_meta_model("tiny-llama"), plan=dataclasses.replace(plan, tp_size=2),
                             device="cpu")
        pipe.load_state_dict(state)
        loss = pipe.step(input_ids, target=labels, attention_mask=mask)
        results[name] = _compare(pipe, loss, ref_loss, ref_grads)
        results[name]["norm"] = pipe.clip_grad_norm_(1e9).item()
        results[name]["tp_size"] = pipe.groups.tp_size
    results["ckpt"] = _checkpoint_round_trip(pipe, state, ckpt_dir)
    results["qwen3"] = _qwen3_tp(batch)
    results["tied"] = _tied_tp(batch)
    plan = make_stage_plan(chain, [4, 3], schedule="1f1b", pp_size=2, num_microbatches=2)
    pipe = auto_pipeline(_meta_model("tiny-llama"), plan=dataclasses.replace(plan, dp_size=2),
                         device="cpu")
    pipe.load_state_dict(state)
    dp = pipe.groups.dp_rank
    half = tuple(t[dp * 4:(dp + 1) * 4] for t in batch)
    loss = pipe.step(half[0], target=half[2], attention_mask=half[1])
    results["dp"] = _compare(pipe, loss, ref_loss, ref_grads) | {"dp_rank": dp}
    return results


def _qwen3_tp(batch: tuple) -> dict:
    """Qwen3 at pp 2 x tp 2 (1F1B) against the whole model."""
    config = tiny_config("qwen3", vocab_size=512)
    model = real_model(config)
    input_ids, mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    chain = discover_blocks(build_hf_model(config))
    plan = make_stage_plan(chain, [3, 4], schedule="1f1b", pp_size=2, num_microbatches=4)
    pipe = auto_pipeline(build_hf_model(config), plan=dataclasses.replace(plan, tp_size=2),
                         device="cpu")
    pipe.load_state_dict(model.state_dict())
    loss = pipe.step(input_ids, target=labels, attention_mask=mask)
    return _compare(pipe, loss, out.loss.item(), ref_grads)


def _tied_tp(batch: tuple) -> dict:
    """tiny-llama-tied at pp 2 x tp 2 (GPipe): the embedding on pp rank 0, the tied head
    on pp rank 1, in each of the two pipelines."""
    state, ref_loss, ref_grads = reference("tiny-llama-tied", batch)
    chain = discover_blocks(_meta_model("tiny-llama-tied"))
    plan = make_stage_plan(chain, [3, 4], schedule="gpipe", pp_size=2, num_microbatches=4)
    pipe = auto_pipeline(_meta_model("tiny-llama-tied"),
                         plan=dataclasses.replace(plan, tp_size=2), device="cpu")
    pipe.load_state_dict(state)
    input_ids, mask, labels = batch
    loss = pipe.step(input_ids, target=labels, attention_mask=mask)
    copies = [*ref_grads, "lm_head.weight"]  # the head's copy of the tied weight
    return _compare(pipe, loss, ref_loss, ref_grads) | {"ref_params": copies}


def _checkpoint_round_trip(pipe, state: dict, ckpt_dir: str) -> float:
    """Save the pp 2 x tp 2 model with DCP, load it into the whole unpipelined model on
    every rank: max |loaded - reference| (the reference weights went into the pipe)."""
    save_checkpoint(pipe, None, ckpt_dir, step=1)
    whole = _meta_model("tiny-llama").to_empty(device="cpu")
    load_checkpoint(whole, None, ckpt_dir)
    return max((v - state[k]).abs().max().item() for k, v in whole.state_dict().items())


@pytest.mark.timeout(600)
def test_pp2_tp2_and_pp2_dp2_match_unpipelined(tmp_path):
    """4 gloo ranks; three schedules at pp 2 x tp 2, Qwen3 and tied embeddings, then 1F1B at
    pp 2 x dp 2."""
    results = run_ranks(_tp_worker, 4, tmp_path, str(tmp_path / "ckpt"))
    for name in [*TP_SCHEDULES, "dp", "qwen3", "tied"]:
        for r in results:
            assert r[name]["max_grad_diff"] < TOL, (name, r[name])
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert len(losses) == 2, (name, losses)  # both tp (or dp) ranks of the last stage
        assert all(abs(loss - results[0][name]["ref_loss"]) < TOL for loss in losses), name
        covered = {p for r in results for p in r[name]["params"]}
        assert len(covered) == len(results[0][name]["ref_params"]), name
    for name in TP_SCHEDULES:
        assert all(r[name]["tp_size"] == 2 for r in results)
        # 4 layers x 7 split linear layers, each held by 2 tp ranks
        assert sum(r[name]["num_sharded"] for r in results) == 2 * 28, name
        for r in results:
            assert abs(r[name]["norm"] - r["ref_norm"]) < 1e-4 * r["ref_norm"], (name, r)
    assert all(r["dp"]["num_sharded"] == 0 for r in results)
    assert sorted(r["dp"]["dp_rank"] for r in results) == [0, 0, 1, 1]
    assert all(r["ckpt"] < 1e-7 for r in results), [r["ckpt"] for r in results]

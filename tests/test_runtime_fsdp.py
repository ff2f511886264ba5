"""FSDP2 under pipeline parallelism on real gloo ranks, vs the unpipelined model.

pp 2 x dp 2 (4 ranks): ``auto_pipeline`` shards every block of a stage over the ``dp``
axis (``fully_shard``, the stage as root) when the plan says ``zero_stage`` 3, gathering
parameters once per step or per microbatch; each replica takes half the (padded) batch.
One step must equal ``LlamaForCausalLM`` on the whole batch: the loss and every gradient,
gathered whole with ``full_tensor()``, within 1e-5, and ``clip_grad_norm_`` the
reference's norm; under 1F1B, Interleaved 1F1B with recompute, ZBV, and with tied
embeddings held by two ranks. A DCP checkpoint keeps the original FQNs: it loads into
the unpipelined model and resumes training exactly (optimizer state included). pp 2 x
dp 2 x tp 2 (8 ranks): FSDP on top of tensor and sequence parallelism. Refusals are
one line each, checked without processes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from runtime_helpers import make_stage_plan, padded_batch, planned_blocks, run_ranks
from test_runtime_hf import ALIASES, _meta_model, reference
from torch.distributed.tensor import DTensor

from autopart.errors import RuntimeSetupError
from autopart.intake import discover_blocks
from autopart.runtime import auto_pipeline, load_checkpoint, save_checkpoint
from autopart.runtime.builder import tied_parameters
from autopart.runtime.fsdp import check_fsdp, mixed_precision
from autopart.schema import TrainingSetup

TOL = 1e-5
# case -> (model, schedule, block counts per stage (pp 2), per microbatch, recompute)
CASES = {
    "1f1b-per-step": ("tiny-llama", "1f1b", [4, 3], False, False),
    "1f1b-per-microbatch": ("tiny-llama", "1f1b", [4, 3], True, False),
    "interleaved-recompute": ("tiny-llama", "interleaved-1f1b", [2, 2, 1, 2], False, True),
    "zbv-per-step": ("tiny-llama", "zbv", [2, 2, 2, 1], False, False),
    "tied-per-microbatch": ("tiny-llama-tied", "1f1b", [3, 4], True, False),
}


def _plan(source: str, schedule: str, counts: list[int], *, per_microbatch: bool,
          tp: int = 1, dp: int = 2):
    chain = discover_blocks(_meta_model(source))
    plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=2, num_microbatches=2)
    return dataclasses.replace(plan, tp_size=tp, dp_size=dp, zero_stage=3,
                               reshard_after_forward=per_microbatch)


def _step(pipe, batch: tuple) -> torch.Tensor | None:
    """One step on this replica's slice of the batch."""
    per = batch[0].shape[0] // pipe.groups.dp_size
    rows = slice(pipe.groups.dp_rank * per, (pipe.groups.dp_rank + 1) * per)
    input_ids, mask, labels = (t[rows] for t in batch)
    return pipe.step(input_ids, target=labels, attention_mask=mask)


def _compare(pipe, loss, ref_loss: float, ref_grads: dict) -> dict:
    diffs = {}
    for name, p in pipe.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        ref = ref_grads.get(name, ref_grads.get(ALIASES.get(name, ""), None))
        diffs[name] = (grad - ref).abs().max().item()
    ref_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref_grads.values()))
    return {"loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
            "max_grad_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get),
            "norm": pipe.clip_grad_norm_(1e9).item(), "ref_norm": ref_norm,
            "sharded": all(isinstance(p, DTensor) for p in pipe.parameters())}


def _fsdp_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    batch = padded_batch(512, batch=8, seq_len=12)
    results = {}
    for name, (source, schedule, counts, per_mb, recompute) in CASES.items():
        state, ref_loss, ref_grads = reference(source, batch)
        pipe = auto_pipeline(_meta_model(source), device="cpu",
                             plan=_plan(source, schedule, counts, per_microbatch=per_mb),
                             activation_checkpointing=True if recompute else None)
        pipe.load_state_dict(state)
        results[name] = _compare(pipe, _step(pipe, batch), ref_loss, ref_grads)
        if name == "1f1b-per-step":
            results["checkpoint"] = _checkpoint_and_resume(pipe, batch, ckpt_dir)
    return results


def _checkpoint_and_resume(pipe, batch: tuple, ckpt_dir: str) -> dict:
    """After one AdamW step, save with DCP; (a) load into the unpipelined model: its
    weights are the pipeline's, gathered; (b) a new pipeline loads weights and optimizer
    state, and one more step on both gives the same weights."""
    plan = pipe.plan
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    optimizer.step()
    save_checkpoint(pipe, optimizer, ckpt_dir, step=1)
    whole = _meta_model("tiny-llama").to_empty(device="cpu")
    assert load_checkpoint(whole, None, ckpt_dir) == 1
    saved = dict(whole.named_parameters())
    loaded = max((p.full_tensor() - saved[n]).abs().max().item()
                 for n, p in pipe.named_parameters())
    resumed = auto_pipeline(_meta_model("tiny-llama"), plan=plan, device="cpu")
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    assert load_checkpoint(resumed, resumed_opt, ckpt_dir) == 1
    for model, opt in ((pipe, optimizer), (resumed, resumed_opt)):
        opt.zero_grad()
        _step(model, batch)
        opt.step()
    after = dict(resumed.named_parameters())
    resume = max((p.full_tensor() - after[n].full_tensor()).abs().max().item()
                 for n, p in pipe.named_parameters())
    return {"loaded": loaded, "resumed": resume,
            "keys": sorted(pipe.state_dict()) == sorted(resumed.state_dict())}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_dp2_fsdp_matches_unpipelined_and_checkpoints(tmp_path):
    """4 gloo ranks: each FSDP choice under 1F1B, Interleaved 1F1B with recompute, ZBV and
    tied embeddings; the DCP round trip and resume."""
    results = run_ranks(_fsdp_worker, 4, tmp_path, str(tmp_path / "ckpt"))
    for name in CASES:
        for r in results:
            assert r[name]["max_grad_diff"] < TOL, (name, r[name])
            assert abs(r[name]["norm"] - r[name]["ref_norm"]) < 1e-4 * r[name]["ref_norm"]
            assert r[name]["sharded"], name
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert len(losses) == 2, (name, losses)  # both replicas' last stages
        assert all(abs(x - results[0][name]["ref_loss"]) < TOL for x in losses), name
    for r in results:
        assert r["checkpoint"]["loaded"] < 1e-7 and r["checkpoint"]["resumed"] < 1e-6, r
        assert r["checkpoint"]["keys"]


def _mesh_worker(rank: int, world_size: int) -> dict:
    batch = padded_batch(512, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference("tiny-llama", batch)
    plan = _plan("tiny-llama", "1f1b", [4, 3], per_microbatch=False, tp=2)
    pipe = auto_pipeline(_meta_model("tiny-llama"), plan=plan, device="cpu")
    pipe.load_state_dict(state)
    return _compare(pipe, _step(pipe, batch), ref_loss, ref_grads)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_dp2_tp2_fsdp_on_tensor_parallel_matches_unpipelined(tmp_path):
    """8 gloo ranks: FSDP over dp on top of TP with sequence parallelism (2-D parameters)."""
    results = run_ranks(_mesh_worker, 8, tmp_path)
    for r in results:
        assert r["max_grad_diff"] < TOL, r
        assert abs(r["norm"] - r["ref_norm"]) < 1e-4 * r["ref_norm"], r
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 4 and all(abs(x - results[0]["ref_loss"]) < TOL for x in losses)


def test_what_fsdp_cannot_shard_is_refused_in_one_line():
    """A split head, a sliced half, a tied weight in two stages of one rank, and
    per-microbatch gathering under a split-backward schedule."""
    model = _meta_model("tiny-llama-tied")
    chain = discover_blocks(model)
    ties = tied_parameters(model, chain)
    check_fsdp(_plan("tiny-llama-tied", "1f1b", [3, 4], per_microbatch=True), ties, chain,
               split_head=False)
    with pytest.raises(RuntimeSetupError, match="tied embedding and head on one rank"):
        check_fsdp(_plan("tiny-llama-tied", "zbv", [2, 2, 2, 1], per_microbatch=False),
                   ties, chain, split_head=False)
    with pytest.raises(RuntimeSetupError, match="--dp-shard params-per-step"):
        check_fsdp(_plan("tiny-llama", "zbv", [2, 2, 2, 1], per_microbatch=True), [], chain,
                   split_head=False)
    split = dataclasses.replace(make_stage_plan(chain, [7, 1], schedule="1f1b", pp_size=2,
                                                num_microbatches=2,
                                                blocks=planned_blocks(chain, vocab=2)),
                                dp_size=2, zero_stage=3)
    with pytest.raises(RuntimeSetupError, match="splits the head by vocabulary"):
        check_fsdp(split, [], chain, split_head=True)


def test_mixed_precision_follows_the_plan():
    """bf16-mixed: bf16 compute weights gathered from fp32 shards, gradients reduced in fp32;
    plain fp32: nothing cast."""
    mixed = mixed_precision(TrainingSetup(pp_size=1, num_microbatches=1, param_dtype="bfloat16",
                                          master_weights=True))
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain = mixed_precision(TrainingSetup(pp_size=1, num_microbatches=1))
    assert plain.param_dtype is None and plain.reduce_dtype is None

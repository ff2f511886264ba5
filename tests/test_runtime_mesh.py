"""Tensor and data parallelism inside the pipeline, on 4 real gloo ranks, vs the unpipelined model.

pp 2 x tp 2: ``auto_pipeline`` builds the ``("pp", "dp", "tp")`` mesh from the plan and
splits tiny-llama as the planner prices it: its attention and MLP layers as its
``base_model_tp_plan`` says, the embedding and head by vocabulary (the loss folded from
the tp ranks' vocabulary shards), and, with sequence parallelism, the norms on sequence
shards with one shard per tp rank crossing each cut. One training step must equal
``LlamaForCausalLM`` on the whole (padded) batch: the loss and every gradient, gathered
whole from its shards with ``full_tensor()``, within 1e-5; the global grad norm of
``clip_grad_norm_`` equals the reference's (each shard counted once). Sequence
parallelism on and off, under 1F1B, ZBV (with recompute) and Interleaved 1F1B; Qwen3's
per-head ``q_norm``/``k_norm`` see only their rank's heads (their gradients summed over
the tp group); tied embeddings held by one rank (ZBV's V) and by two; a custom
``loss_fn`` gets the logits gathered whole. pp 2 x dp 2: the mesh comes from the plan
too; each replica takes half the batch.

The plans' ``tp_size`` / ``dp_size`` / ``sequence_parallel`` are written by hand
(``dataclasses.replace``) on a contiguous plan: the planner's mesh search is not what is
tested here.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from families import real_model, tiny_config
from runtime_helpers import make_stage_plan, padded_batch, run_ranks
from test_runtime_hf import ALIASES, _meta_model, reference
from torch.distributed.tensor import DTensor

from autopart import CausalLMLoss
from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime import auto_pipeline, load_checkpoint, save_checkpoint
from autopart.runtime.tensor_parallel import is_sharded

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
# case -> (model, schedule, block counts per stage (7 blocks, pp 2, 4 microbatches),
#          sequence parallelism, recompute)
TP_CASES = {
    "1f1b-sp": ("tiny-llama", "1f1b", [4, 3], True, False),
    "1f1b": ("tiny-llama", "1f1b", [4, 3], False, False),
    "zbv-sp-recompute": ("tiny-llama", "zbv", [2, 2, 2, 1], True, True),
    "interleaved-1f1b": ("tiny-llama", "interleaved-1f1b", [2, 2, 1, 2], False, False),
    "tied-zbv-sp": ("tiny-llama-tied", "zbv", [2, 2, 2, 1], True, False),  # tied on one rank
    "tied-1f1b": ("tiny-llama-tied", "1f1b", [3, 4], False, False),  # tied on two ranks
}


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


def _received_seq_len(pipe) -> int | None:
    """Sequence length of what this rank's first stage receives (None: it receives nothing)."""
    stage = pipe.pipe_stages[0]
    infos = [i for i in stage.args_recv_info.get(0, ()) if getattr(i, "buffer", None) is not None
             and not getattr(i, "is_root_arg", False)]
    return infos[0].buffer.shape[1] if infos else None


def _tp_worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    batch = padded_batch(512, batch=8, seq_len=12)
    input_ids, mask, labels = batch
    results = {}
    for name, (source, schedule, counts, sp, recompute) in TP_CASES.items():
        state, ref_loss, ref_grads = reference(source, batch)
        chain = discover_blocks(_meta_model(source))
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=2, num_microbatches=4)
        pipe = auto_pipeline(_meta_model(source), device="cpu",
                             plan=dataclasses.replace(plan, tp_size=2, sequence_parallel=sp),
                             activation_checkpointing=True if recompute else None)
        pipe.load_state_dict(state)
        loss = pipe.step(input_ids, target=labels, attention_mask=mask)
        # tied on two ranks: the head's copy of the tied weight under its own FQN
        copies = [*ref_grads, "lm_head.weight"] if name == "tied-1f1b" else list(ref_grads)
        results[name] = _compare(pipe, loss, ref_loss, ref_grads) | {"ref_params": copies}
        ref_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref_grads.values()))
        results[name].update(norm=pipe.clip_grad_norm_(1e9).item(), ref_norm=ref_norm,
                             tp_size=pipe.groups.tp_size, received=_received_seq_len(pipe))
        if name == "1f1b-sp":
            results["ckpt"] = _checkpoint_round_trip(pipe, state, ckpt_dir)
    results["qwen3-sp"] = _qwen3_tp(batch)
    results["custom-loss"] = _custom_loss_tp()
    return results


def _qwen3_tp(batch: tuple) -> dict:
    """Qwen3 at pp 2 x tp 2 (1F1B, sequence parallelism) against the whole model."""
    config = tiny_config("qwen3", vocab_size=512)
    model = real_model(config)
    input_ids, mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    chain = discover_blocks(build_hf_model(config))
    plan = make_stage_plan(chain, [3, 4], schedule="1f1b", pp_size=2, num_microbatches=4)
    pipe = auto_pipeline(build_hf_model(config), device="cpu",
                         plan=dataclasses.replace(plan, tp_size=2, sequence_parallel=True))
    pipe.load_state_dict(model.state_dict())
    loss = pipe.step(input_ids, target=labels, attention_mask=mask)
    return _compare(pipe, loss, out.loss.item(), ref_grads)


def _custom_loss_tp() -> dict:
    """A custom loss_fn (per-microbatch token mean; GPipe, sequence parallelism) gets the
    logits gathered whole: on an unpadded batch the mean of its microbatch losses is the
    whole batch's token mean."""
    batch = padded_batch(512, batch=8, seq_len=12)
    input_ids = batch[0].clamp(min=3)
    full = (input_ids, torch.ones_like(input_ids), input_ids)
    state, ref_loss, ref_grads = reference("tiny-llama", full)
    chain = discover_blocks(_meta_model("tiny-llama"))
    plan = make_stage_plan(chain, [3, 4], schedule="gpipe", pp_size=2, num_microbatches=4)
    builtin = CausalLMLoss()
    pipe = auto_pipeline(_meta_model("tiny-llama"), device="cpu",
                         plan=dataclasses.replace(plan, tp_size=2, sequence_parallel=True),
                         loss_fn=lambda logits, target: builtin(logits, target))
    pipe.load_state_dict(state)
    loss = pipe.step(input_ids, target=input_ids)
    return _compare(pipe, loss, ref_loss, ref_grads)


def _checkpoint_round_trip(pipe, state: dict, ckpt_dir: str) -> float:
    """Save the pp 2 x tp 2 model with DCP, load it into the whole unpipelined model on
    every rank: max |loaded - reference| (the reference weights went into the pipe)."""
    save_checkpoint(pipe, None, ckpt_dir, step=1)
    whole = _meta_model("tiny-llama").to_empty(device="cpu")
    load_checkpoint(whole, None, ckpt_dir)
    return max((v - state[k]).abs().max().item() for k, v in whole.state_dict().items())


@pytest.mark.timeout(900)
def test_pp2_tp2_matches_unpipelined(tmp_path):
    """4 gloo ranks: six pp 2 x tp 2 cases (sequence parallelism on and off, three schedules,
    recompute, tied embeddings on one and on two ranks), Qwen3, a custom loss_fn; a DCP
    checkpoint of the sequence-parallel model loads into the unpipelined one."""
    results = run_ranks(_tp_worker, 4, tmp_path, str(tmp_path / "ckpt"))
    for name in [*TP_CASES, "qwen3-sp", "custom-loss"]:
        for r in results:
            assert r[name]["max_grad_diff"] < TOL, (name, r[name])
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert len(losses) == 2, (name, losses)  # both tp ranks of the last stage
        assert all(abs(loss - results[0][name]["ref_loss"]) < TOL for loss in losses), name
        covered = {p for r in results for p in r[name]["params"]}
        assert len(covered) == len(results[0][name]["ref_params"]), name
    for name, (_, _, _, sp, _) in TP_CASES.items():
        assert all(r[name]["tp_size"] == 2 for r in results)
        # 4 layers x 7 split linear layers + the embedding and the head (one parameter when
        # tied on one rank), each held by 2 tp ranks
        split = 28 + (1 if name == "tied-zbv-sp" else 2)
        assert sum(r[name]["num_sharded"] for r in results) == 2 * split, name
        for r in results:
            assert abs(r[name]["norm"] - r[name]["ref_norm"]) < 1e-4 * r[name]["ref_norm"], \
                (name, r[name])
        # what crosses a cut: 12 positions, half each with sequence parallelism
        received = {r[name]["received"] for r in results} - {None}
        assert received == {6 if sp else 12}, (name, received)
    assert all(r["ckpt"] < 1e-7 for r in results), [r["ckpt"] for r in results]


def _dp_worker(rank: int, world_size: int) -> dict:
    batch = padded_batch(512, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference("tiny-llama", batch)
    chain = discover_blocks(_meta_model("tiny-llama"))
    plan = make_stage_plan(chain, [4, 3], schedule="1f1b", pp_size=2, num_microbatches=2)
    pipe = auto_pipeline(_meta_model("tiny-llama"), plan=dataclasses.replace(plan, dp_size=2),
                         device="cpu")
    pipe.load_state_dict(state)
    dp = pipe.groups.dp_rank
    half = tuple(t[dp * 4:(dp + 1) * 4] for t in batch)
    loss = pipe.step(half[0], target=half[2], attention_mask=half[1])
    return _compare(pipe, loss, ref_loss, ref_grads) | {"dp_rank": dp}


@pytest.mark.timeout(300)
def test_pp2_dp2_matches_unpipelined(tmp_path):
    """4 gloo ranks, 1F1B at pp 2 x dp 2 (gradients all-reduced): each replica takes half
    the batch; the loss is the token mean over both."""
    results = run_ranks(_dp_worker, 4, tmp_path)
    for r in results:
        assert r["max_grad_diff"] < TOL, r
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 2 and all(abs(x - results[0]["ref_loss"]) < TOL for x in losses)
    assert all(r["num_sharded"] == 0 for r in results)
    assert sorted(r["dp_rank"] for r in results) == [0, 0, 1, 1]

"""Pipelined HF causal LMs on real gloo ranks vs the unpipelined model.

Every schedule, padded batches with an attention mask: the loss and every
parameter gradient must equal those of ``LlamaForCausalLM`` on the whole batch
(max abs diff < 1e-5 in fp32). Each rank compares its own parameters against a
reference it computes locally (the models are tiny).
"""

from __future__ import annotations

import pytest
import torch
from families import init_real
from runtime_helpers import make_stage_plan, max_grad_diffs, padded_batch, run_ranks
from transformers import LlamaConfig

from autopart.intake import discover_blocks, load_model
from autopart.intake.sources import build_hf_model
from autopart.profile import ProfileOptions
from autopart.runtime import auto_pipeline
from autopart.solve import PlanOptions

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}

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


def reference(source: str | LlamaConfig, batch: tuple[torch.Tensor, ...], seed: int = 0):
    """Real-weight model, its state dict, loss and gradients on the whole batch."""
    model = _meta_model(source)
    torch.manual_seed(seed)
    init_real(model)
    input_ids, mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, out.loss.item(), grads


def _meta_model(source: str | LlamaConfig) -> torch.nn.Module:
    if isinstance(source, LlamaConfig):
        return build_hf_model(source)
    return load_model(source).model


def _run_schedule(pipe, batch, ref_loss: float, ref_grads: dict) -> dict:
    """One step of ``pipe`` on ``batch``; loss and max grad diff against the reference."""
    input_ids, mask, labels = batch
    loss = pipe.step(input_ids, target=labels, attention_mask=mask)
    diffs = max_grad_diffs(pipe.named_parameters(), ref_grads, ALIASES)
    return {"loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
            "max_grad_diff": max(diffs.values()), "params": sorted(diffs),
            "worst": max(diffs, key=diffs.get)}


def _schedules_worker(rank: int, world_size: int, source, schedules: dict) -> dict:
    batch = padded_batch(_meta_model(source).config.vocab_size, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference(source, batch)
    chain = discover_blocks(_meta_model(source))
    results = {}
    for name, (counts, num_mb) in schedules.items():
        plan = make_stage_plan(chain, counts, schedule=name, pp_size=world_size,
                         num_microbatches=num_mb)
        pipe = auto_pipeline(_meta_model(source), plan=plan, device="cpu")
        pipe.load_state_dict(state)
        results[name] = _run_schedule(pipe, batch, ref_loss, ref_grads)
        if chain.tied_embeddings:  # the two copies of the tied weight stay equal
            torch.optim.SGD(pipe.parameters(), lr=1.0).step()
            tied = dict(pipe.named_parameters())
            weight = tied.get("model.embed_tokens.weight", tied.get("lm_head.weight"))
            results[name]["tied_sum"] = None if weight is None else weight.sum().item()
    results["num_ref_params"] = len(ref_grads)
    return results


def _check(results: list[dict], schedules: dict, *, tied: bool = False) -> None:
    for name in schedules:
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert losses, f"{name}: no rank returned a loss"
        for r in results:
            assert r[name]["max_grad_diff"] < TOL, (name, r[name])
        for loss in losses:
            assert abs(loss - results[0][name]["ref_loss"]) < TOL, (name, loss)
        num_copies = 1
        if tied:  # two copies when the embedding and the head sit on different ranks
            sums = [r[name]["tied_sum"] for r in results if r[name]["tied_sum"] is not None]
            assert len(sums) in (1, 2) and max(sums) - min(sums) < 1e-6, (name, sums)
            num_copies = len(sums)
        covered = {p for r in results for p in r[name]["params"]}
        assert len(covered) == results[0]["num_ref_params"] + num_copies - 1, (name, covered)


@pytest.mark.timeout(240)
def test_every_schedule_matches_unpipelined_llama(tmp_path):
    """tiny-llama on 2 ranks, each schedule: loss and grads equal LlamaForCausalLM's."""
    results = run_ranks(_schedules_worker, 2, tmp_path, "tiny-llama", SCHEDULES_PP2)
    _check(results, SCHEDULES_PP2)


def test_padded_batch_changes_the_loss():
    """The test batch really exercises the mask: dropping it changes the reference loss."""
    input_ids, mask, labels = padded_batch(512, batch=8, seq_len=12)
    assert (mask == 0).any(dim=1).sum() >= 4
    _, with_mask, _ = reference("tiny-llama", (input_ids, mask, labels))
    _, without_mask, _ = reference("tiny-llama", (input_ids, None, labels))
    assert abs(with_mask - without_mask) > 1e-3


TIED_SCHEDULES = {name: SCHEDULES_PP2[name] for name in ("gpipe", "interleaved-1f1b", "zbv")}


@pytest.mark.timeout(240)
def test_tied_embeddings_match_unpipelined(tmp_path):
    """tiny-llama-tied: the tied weight's gradient is summed over its two copies (or shared
    on one rank under V placement); grads equal the reference and the copies stay equal."""
    results = run_ranks(_schedules_worker, 2, tmp_path, "tiny-llama-tied", TIED_SCHEDULES)
    _check(results, TIED_SCHEDULES, tied=True)


SMALL_LLAMA = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 64}
# 9 blocks (embedding, 6 layers, norm, head) on 4 ranks
SCHEDULES_PP4 = {
    "1f1b": ([3, 2, 2, 2], 4),
    "interleaved-1f1b": ([2, 1, 1, 1, 1, 1, 1, 1], 4),
    "zbv": ([1, 1, 1, 1, 1, 1, 1, 2], 8),
}


def _mesh_worker(rank: int, world_size: int, config_kwargs: dict) -> dict:
    """pp=4 schedules, then a 2-D mesh (pp=2 x dp=2) where each replica takes half the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    config = LlamaConfig(**config_kwargs)
    results = _schedules_worker(rank, world_size, config, SCHEDULES_PP4)
    batch = padded_batch(config.vocab_size, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference(config, batch)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh["dp"].get_local_rank()
    half = tuple(t[dp_rank * 4:(dp_rank + 1) * 4] for t in batch)
    chain = discover_blocks(_meta_model(config))
    for name, counts in (("1f1b", [5, 4]), ("interleaved-zb", [3, 2, 2, 2])):
        plan = make_stage_plan(chain, counts, schedule=name, pp_size=2, num_microbatches=2)
        pipe = auto_pipeline(_meta_model(config), plan=plan, device="cpu", device_mesh=mesh)
        pipe.load_state_dict(state)
        results[f"dp:{name}"] = _run_schedule(pipe, half, ref_loss, ref_grads)
    return results


@pytest.mark.timeout(400)
def test_four_ranks_and_data_parallel_mesh(tmp_path):
    """4 gloo ranks: pp=4 (1F1B, interleaved, ZBV) and pp=2 x dp=2 on a DeviceMesh, where
    grads are all-reduced over dp and the loss is the token mean of the global batch."""
    results = run_ranks(_mesh_worker, 4, tmp_path, SMALL_LLAMA)
    _check(results, SCHEDULES_PP4)
    for name in ("dp:1f1b", "dp:interleaved-zb"):
        for r in results:
            assert r[name]["max_grad_diff"] < TOL, (name, r[name])
            if r[name]["loss"] is not None:
                assert abs(r[name]["loss"] - r[name]["ref_loss"]) < TOL, (name, r[name])
        assert sum(r[name]["loss"] is not None for r in results) == 2, name


def _auto_worker(rank: int, world_size: int) -> dict:
    batch = padded_batch(512, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference("tiny-llama", batch)
    pipe = auto_pipeline("tiny-llama", plan="auto", device="cpu",
                         profile_options=ProfileOptions(micro_batch_size=2, seq_len=12,
                                                        num_warmup=1, num_repeats=2),
                         plan_options=PlanOptions(pp_size=world_size, num_microbatches=4))
    pipe.load_state_dict(state)
    return _run_schedule(pipe, batch, ref_loss, ref_grads) | {"plan": pipe.plan.to_json()}


@pytest.mark.timeout(240)
def test_auto_plan_is_solved_on_rank0_and_shared(tmp_path):
    """plan='auto': rank 0 profiles and solves, every rank runs the same plan, grads exact."""
    results = run_ranks(_auto_worker, 2, tmp_path)
    assert results[0]["plan"] == results[1]["plan"]
    assert all(r["max_grad_diff"] < TOL for r in results), results
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(loss - results[0]["ref_loss"]) < TOL for loss in losses)

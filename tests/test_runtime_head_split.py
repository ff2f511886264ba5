"""A head split by vocabulary over several stages, on real gloo ranks, vs the unpipelined model.

tiny-llama and tiny-llama-tied (7 blocks: embedding, 4 layers, norm, head) with the
head split into 2 or 3 shard blocks, under 1F1B, Interleaved 1F1B and ZBV, on a
padded batch: the loss and every parameter gradient equal those of
``LlamaForCausalLM`` on the whole batch (max abs diff < 1e-5 in fp32).
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_stage_plan, max_grad_diffs, padded_batch, planned_blocks, run_ranks
from test_runtime_hf import ALIASES, TOL, _meta_model, reference

from autopart.errors import RuntimeSetupError
from autopart.intake import discover_blocks
from autopart.runtime import auto_pipeline

# schedule -> (shards, block counts per stage, microbatches), pp = 2
SPLITS = {
    "1f1b": (2, [7, 1], 4),                     # rank 0: .. norm, shard 0; rank 1: shard 1
    "interleaved-1f1b": (3, [4, 3, 1, 1], 4),   # shard 0 on rank 1, 1 on rank 0, 2 on rank 1
    "zbv": (2, [2, 2, 3, 1], 4),                # V: shard 0 on rank 1, shard 1 with the embedding
}


def _worker(rank: int, world_size: int, source: str) -> dict:
    batch = padded_batch(_meta_model(source).config.vocab_size, batch=8, seq_len=12)
    state, ref_loss, ref_grads = reference(source, batch)
    chain = discover_blocks(_meta_model(source))
    results = {}
    for name, (num_shards, counts, num_mb) in SPLITS.items():
        plan = make_stage_plan(chain, counts, schedule=name, pp_size=world_size,
                               num_microbatches=num_mb,
                               blocks=planned_blocks(chain, vocab=num_shards))
        pipe = auto_pipeline(_meta_model(source), plan=plan, device="cpu")
        pipe.load_state_dict(state)
        input_ids, mask, labels = batch
        loss = pipe.step(input_ids, target=labels, attention_mask=mask)
        diffs = max_grad_diffs(pipe.named_parameters(), ref_grads, ALIASES)
        torch.optim.SGD(pipe.parameters(), lr=1.0).step()  # the copies of the head stay equal
        params = dict(pipe.named_parameters())
        head = params.get("lm_head.weight", params.get("model.embed_tokens.weight"))
        results[name] = {"loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
                         "diffs": diffs, "head_sum": None if head is None else head.sum().item()}
    results["num_ref_params"] = len(ref_grads)
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["tiny-llama", "tiny-llama-tied"])
def test_head_split_matches_unpipelined(tmp_path, source):
    """Loss and every gradient equal the unpipelined model's; every rank ends with the
    same head weight after an optimizer step; every parameter is covered."""
    results = run_ranks(_worker, 2, tmp_path, source)
    for name in SPLITS:
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert len(losses) == 1 and abs(losses[0] - results[0][name]["ref_loss"]) < TOL
        for r in results:
            assert max(r[name]["diffs"].values()) < TOL, (name, r[name]["diffs"])
        sums = [r[name]["head_sum"] for r in results]
        assert None not in sums and max(sums) - min(sums) < 1e-6, (name, sums)
        covered = {p for r in results for p in r[name]["diffs"]}
        covered.discard("lm_head.weight" if source.endswith("tied") else "")
        assert len(covered) == results[0]["num_ref_params"], (name, covered)


def test_custom_loss_fn_is_refused_with_a_split_head():
    """A split head computes the token-mean loss itself: a loss_fn is refused in one line."""
    from autopart.runtime.validate import check_parts

    model = _meta_model("tiny-llama")
    chain = discover_blocks(model)
    blocks = planned_blocks(chain, vocab=2)
    plan = make_stage_plan(chain, [7, 1], schedule="1f1b", pp_size=2, num_microbatches=2,
                           blocks=blocks)
    assert [d.part.index for d in check_parts(plan, chain, model, has_loss_fn=False)] == [0, 1]
    with pytest.raises(RuntimeSetupError, match=r"cannot see whole; pass "
                                                 r"loss_fn=autopart.CausalLMLoss\(\)"):
        check_parts(plan, chain, model, has_loss_fn=True)
    swapped = blocks[:-2] + blocks[-2:][::-1]
    plan = make_stage_plan(chain, [7, 1], schedule="1f1b", pp_size=2, num_microbatches=2,
                           blocks=swapped)
    with pytest.raises(RuntimeSetupError, match="in order"):
        check_parts(plan, chain, model, has_loss_fn=False)

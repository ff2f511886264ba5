"""Every HF decoder family, pipelined on 2 gloo ranks, against the unpipelined model.

For each family's tiny config: the loss and every parameter gradient of one step on
a padded batch must equal those of the same model (same weights) run whole on the
CPU, max abs diff < 1e-5 in fp32, under 1F1B and under Interleaved 1F1B. The blocks
come from watching the model's forward, and every stage runs that forward itself.
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, FAMILIES_ALL, real_model, reference_run, tiny_config
from runtime_helpers import make_stage_plan, max_grad_diffs, run_ranks

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime import auto_pipeline
from autopart.runtime.builder import tied_parameters

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
# schedule -> stage sizes for the 7 blocks (embedding, 4 layers, norm-or-not, head), pp = 2
PLANS = {"1f1b": [4, 3], "interleaved-1f1b": [2, 2, 1, 2]}


def _worker(rank: int, world_size: int, model_type: str, tie: bool) -> dict:
    config = tiny_config(model_type, tie_word_embeddings=tie)
    state, input_ids, mask, labels, ref_loss, ref_grads = reference_run(config)
    chain = discover_blocks(build_hf_model(tiny_config(model_type, tie_word_embeddings=tie)))
    aliases = {b: a for a, b in tied_parameters(build_hf_model(config), chain)}
    results = {}
    for schedule, counts in PLANS.items():
        counts = list(counts)
        counts[-1] += len(chain.blocks) - sum(counts)
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=4)
        pipe = auto_pipeline(build_hf_model(tiny_config(model_type, tie_word_embeddings=tie)),
                             plan=plan, device="cpu")
        pipe.load_state_dict(state, strict=False)
        loss = pipe.step(input_ids, target=labels, attention_mask=mask)
        diffs = max_grad_diffs(pipe.named_parameters(), ref_grads, aliases)
        results[schedule] = {"loss": None if loss is None else loss.item(),
                             "ref_loss": ref_loss, "max_grad_diff": max(diffs.values()),
                             "worst": max(diffs, key=diffs.get), "num_params": len(diffs)}
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", sorted(FAMILIES_ALL))
def test_family_trains_exactly(tmp_path, model_type):
    """Loss and every gradient equal the unpipelined model's, under 1F1B and Interleaved 1F1B."""
    tie = model_type in ("gemma", "gemma2", "gemma3_text", "gpt2", "gpt_bigcode", "bloom",
                         "cohere", "mamba")
    results = run_ranks(_worker, 2, tmp_path, model_type, tie)
    for schedule in PLANS:
        losses = [r[schedule]["loss"] for r in results if r[schedule]["loss"] is not None]
        assert len(losses) == 1, (schedule, results)
        assert abs(losses[0] - results[0][schedule]["ref_loss"]) < TOL, (schedule, results)
        for r in results:
            assert r[schedule]["num_params"] > 0
            assert r[schedule]["max_grad_diff"] < TOL, (schedule, r[schedule])
    total = sum(r["1f1b"]["num_params"] for r in results)
    assert total >= len(list(real_model(tiny_config(model_type)).named_parameters())) - 1


def test_tiny_configs_build_on_meta():
    """Every family's tiny config builds with parameters on meta and real rotary buffers."""
    for model_type in FAMILIES:
        model = build_hf_model(tiny_config(model_type))
        assert all(p.is_meta for p in model.parameters()), model_type
        assert not any(b.is_meta for b in model.buffers()), model_type
        assert torch.isfinite(torch.tensor(len(discover_blocks(model).blocks)))

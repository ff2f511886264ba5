"""Pipeline cuts inside decoder layers train exactly like the unpipelined model.

Each family's tiny config is profiled at ``sublayer`` granularity (11 blocks:
embedding, 4 x (attention half, MLP half), norm, head) and cut after attention
halves, on 2 gloo ranks. The loss and every parameter gradient of one step on a
padded batch must equal those of the same model (same weights) run whole, max abs
diff < 1e-5 in fp32; every schedule is run for Llama, a head split into vocabulary
shards is combined with the halves once, and the ranks' state dicts together carry
exactly the original model's keys.
"""

from __future__ import annotations

import pytest
from families import reference_run, tiny_config
from runtime_helpers import check_exact, exact_step, make_stage_plan, planned_blocks, run_ranks

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime.builder import tied_parameters

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
# block index: 0 embedding, 1 L0.attn, 2 L0.mlp, 3 L1.attn, 4 L1.mlp, 5 L2.attn, 6 L2.mlp,
# 7 L3.attn, 8 L3.mlp, 9 norm, 10 head; every plan cuts after at least one attention half
EVERY_SCHEDULE = {
    "gpipe": [4, 7],
    "1f1b": [2, 9],
    "interleaved-1f1b": [2, 3, 3, 3],
    "looped-bfs": [4, 2, 2, 3],
    "interleaved-zb": [2, 2, 2, 5],
    "zbv": [4, 2, 2, 3],
    "dualpipev": [2, 4, 2, 3],
}
TWO = {name: EVERY_SCHEDULE[name] for name in ("1f1b", "interleaved-1f1b")}
# "<schedule>:<k>": the head split into k vocabulary shards too (12 blocks for k = 2)
WITH_SHARDS = {"1f1b:2": [4, 8], "interleaved-1f1b:2": [2, 3, 6, 1]}
TIED = ("gemma3_text", "gpt2")


def _worker(rank: int, world_size: int, model_type: str, plans: dict,
            recompute: bool) -> dict:
    tie = model_type in TIED
    config = tiny_config(model_type, tie_word_embeddings=tie)
    reference = reference_run(config)
    chain = discover_blocks(build_hf_model(config), granularity="half")
    assert chain.granularity == "half" and len(chain.blocks) == 11, chain.notes
    aliases = {b: a for a, b in tied_parameters(build_hf_model(config), chain)}
    results = {"ref_loss": reference.loss, "ref_keys": sorted(reference.state)}
    for key, counts in plans.items():
        schedule, _, shards = key.partition(":")
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=4,
                               blocks=planned_blocks(chain, vocab=int(shards or 0)))
        results[key] = exact_step(config, plan, reference, aliases, recompute)
    return results


@pytest.mark.timeout(300)
def test_every_schedule_with_cuts_inside_layers_llama(tmp_path):
    """gpipe, 1F1B, interleaved, looped BFS, zero-bubble, ZBV, DualPipeV against the whole model."""
    check_exact(run_ranks(_worker, 2, tmp_path, "llama", EVERY_SCHEDULE, False),
                EVERY_SCHEDULE, TOL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text", "gpt2", "mixtral", "opt"])
def test_family_with_cuts_inside_layers(tmp_path, model_type):
    """1F1B and Interleaved 1F1B with cuts after attention halves (tied heads included)."""
    check_exact(run_ranks(_worker, 2, tmp_path, model_type, TWO, False), TWO, TOL)


@pytest.mark.timeout(240)
def test_recomputed_halves_train_exactly(tmp_path):
    """Activation checkpointing of every half gives the same loss and gradients."""
    check_exact(run_ranks(_worker, 2, tmp_path, "llama", TWO, True), TWO, TOL)


@pytest.mark.timeout(240)
def test_halves_with_a_split_head_train_exactly(tmp_path):
    """Cuts inside layers and between vocabulary shards of the head in one plan."""
    check_exact(run_ranks(_worker, 2, tmp_path, "qwen2", WITH_SHARDS, False), WITH_SHARDS, TOL)

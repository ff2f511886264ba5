"""Pipeline cuts inside the halves of decoder layers train exactly like the unpipelined model.

Each family's tiny config is discovered at ``projection`` granularity (19 blocks for four
layers: embedding, 4 x (attention up to o_proj, o_proj, MLP up to down_proj, down_proj),
norm, head) and cut before output projections, where two values cross (the attention
output or ``act(gate) * up``, and the residual), on 2 gloo ranks. The loss and every
parameter gradient of one step on a padded batch must equal those of the same model
(same weights) run whole, max abs diff < 1e-5 in fp32, under every schedule for Llama,
with checkpointed stages, and for other families; the ranks' state dicts together
carry exactly the original model's keys.
"""

from __future__ import annotations

import pytest
from families import reference_run, tiny_config
from runtime_helpers import check_exact, exact_step, make_stage_plan, run_ranks

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime.builder import tied_parameters

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
# block index: 0 embedding; layer i: 1 + 4i attention up to o_proj, 2 + 4i o_proj,
# 3 + 4i MLP up to down_proj, 4 + 4i down_proj; 17 norm, 18 head. A stage ending at
# 1 + 4i sends the attention output and the residual, at 3 + 4i act(gate) * up and it.
EVERY_SCHEDULE = {
    "gpipe": [4, 15],
    "1f1b": [2, 17],
    "interleaved-1f1b": [2, 2, 4, 11],
    "looped-bfs": [4, 2, 4, 9],
    "interleaved-zb": [2, 2, 6, 9],
    "zbv": [4, 2, 4, 9],
    "dualpipev": [2, 2, 4, 11],
}
TWO = {name: EVERY_SCHEDULE[name] for name in ("1f1b", "interleaved-1f1b")}
TIED = ("gemma3_text", "gpt2")


def _worker(rank: int, world_size: int, model_type: str, plans: dict, recompute: bool,
            num_blocks: int) -> dict:
    tie = model_type in TIED
    config = tiny_config(model_type, tie_word_embeddings=tie)
    reference = reference_run(config)
    chain = discover_blocks(build_hf_model(config), granularity="projection")
    assert chain.granularity == "projection" and len(chain.blocks) == num_blocks, chain.notes
    aliases = {b: a for a, b in tied_parameters(build_hf_model(config), chain)}
    results = {"ref_loss": reference.loss, "ref_keys": sorted(reference.state)}
    for schedule, counts in plans.items():
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=4)
        results[schedule] = exact_step(config, plan, reference, aliases, recompute)
    return results


@pytest.mark.timeout(400)
def test_every_schedule_with_cuts_before_output_projections_llama(tmp_path):
    """gpipe, 1F1B, interleaved, looped BFS, zero-bubble, ZBV, DualPipeV against the whole model."""
    check_exact(run_ranks(_worker, 2, tmp_path, "llama", EVERY_SCHEDULE, False, 19),
           EVERY_SCHEDULE, TOL)


@pytest.mark.timeout(240)
def test_recomputed_projection_parts_train_exactly(tmp_path):
    """Checkpointed stages (a stage ending inside a half checkpoints it up to the cut), also
    under zero-bubble split backward (the residual sent is a checkpoint's saved input)."""
    plans = {**TWO, "zbv": EVERY_SCHEDULE["zbv"]}
    check_exact(run_ranks(_worker, 2, tmp_path, "llama", plans, True, 19), plans, TOL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text", "gpt2"])
def test_family_with_cuts_before_output_projections(tmp_path, model_type):
    """1F1B and Interleaved 1F1B (tied heads, post-norms, Conv1D projections included)."""
    check_exact(run_ranks(_worker, 2, tmp_path, model_type, TWO, False, 19), TWO, TOL)


@pytest.mark.timeout(240)
def test_moe_keeps_its_mlp_half_whole(tmp_path):
    """Mixtral: the router's token indices cross before the experts, so only the attention
    half splits (15 blocks: embedding, 4 x (attention, o_proj, MoE half), norm, head)."""
    plans = {"1f1b": [2, 13], "interleaved-1f1b": [2, 3, 3, 7]}
    check_exact(run_ranks(_worker, 2, tmp_path, "mixtral", plans, False, 15), plans, TOL)


def _planned_worker(rank: int, world_size: int, plan) -> dict:
    config = tiny_config("llama")
    reference = reference_run(config)
    model = build_hf_model(config)
    aliases = {b: a for a, b in tied_parameters(model, discover_blocks(model))}
    return {"ref_loss": reference.loss, "ref_keys": sorted(reference.state),
            "planned": exact_step(config, plan, reference, aliases, False)}


@pytest.mark.timeout(240)
def test_a_cut_named_after_the_attention_half_trains_exactly(tmp_path):
    """``--cuts model.layers.2.self_attn`` on a default cpu profile: the cut after the
    attention half's output projection, named by the module whose call ends there (the
    profile's block there is ``model.layers.2.self_attn.o_proj``); the plan prints that
    shortest name and the runtime runs it exactly on 2 ranks."""
    from autopart.profile import profile_model
    from autopart.solve import make_plan

    profile = profile_model(build_hf_model(tiny_config("llama")), backend="cpu", seq_len=8,
                            num_warmup=1, num_repeats=2)
    assert profile.setup.granularity == "projection"
    plan = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                     cuts=["model.layers.2.self_attn"])
    assert plan.pipeline_cuts == ("model.layers.2.self_attn",)
    assert plan.stages[0].modules[-1] == "model.layers.2.self_attn.o_proj"
    same = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                     cuts=["model.layers.2.self_attn.o_proj"])
    assert same.stages == plan.stages
    check_exact(run_ranks(_planned_worker, 2, tmp_path, plan), {"planned": None}, TOL)

"""Pipeline cuts inside a decoder-layer half's module train exactly like the unpipelined model.

Each family's tiny config is discovered at the ``half`` level (11 blocks for four
layers: embedding, 4 x (attention half, MLP half), norm, head) and three halves are cut
into slices (``autopart.intake.slice_rules``): layer 0's MLP into 4 column groups, layer
1's attention into its 2 KV-head groups, layer 2's MLP into 2. A stage ending inside a
half sends the module's input, the residual and its slices' partial output; the next
adds its slices. On 2 gloo ranks the loss and every parameter gradient of one step on a
padded batch must equal those of the same model (same weights) run whole, max abs diff
< 1e-5 in fp32, under every schedule for Llama (a stage lying inside one half, a stage
starting inside one half and ending inside the next), with checkpointed stages, and for
other families; the ranks' state dicts together carry exactly the original model's keys,
and ``clip_grad_norm_`` reports the unpipelined model's gradient norm (a half held on
both ranks counted once).
"""

from __future__ import annotations

import math

import pytest
from families import reference_run, tiny_config
from runtime_helpers import check_exact, exact_step, make_stage_plan, planned_blocks, run_ranks

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime.builder import tied_parameters

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOL = 1e-5
SLICED = {"model.layers.0.mlp": 4, "model.layers.1.self_attn": 2, "model.layers.2.mlp": 2}
# names: 0 embedding, 1 L0 attention, 2-5 L0 MLP slices 0-3, 6-7 L1 attention slices 0-1,
# 8 L1 MLP, 9 L2 attention, 10-11 L2 MLP slices 0-1, 12 L3 attention, 13 L3 MLP, 14 norm,
# 15 head
MLP_CUT = [3, 13]  # inside L0's MLP
ATTENTION_CUT = [7, 9]  # between L1's KV-head groups
# stage 0 ends inside L0's MLP, stage 1 lies inside it, stage 2 starts inside it and ends
# inside L1's attention, stage 3 starts inside that
INSIDE = [3, 2, 2, 9]
# stage 1 starts inside L1's attention and ends inside L2's MLP, stage 2 finishes it
ACROSS = [7, 4, 1, 4]
EVERY_SCHEDULE = {
    "gpipe": ATTENTION_CUT,
    "1f1b": MLP_CUT,
    "interleaved-1f1b": INSIDE,
    "looped-bfs": ACROSS,
    "interleaved-zb": INSIDE,
    "zbv": INSIDE,
    "dualpipev": ACROSS,
    # the head split into 2 vocabulary shards too (17 names): stage 2 starts inside L0's
    # MLP and ends inside the head
    "interleaved-1f1b:shards": [3, 2, 11, 1],
}
# zero-bubble W recomputes a checkpoint after torch detached the stage's outputs in place
RECOMPUTED = {"1f1b": MLP_CUT, "interleaved-1f1b": INSIDE, "zbv": ACROSS}


def _worker(rank: int, world_size: int, model_type: str, plans: dict, recompute: bool,
            sliced: dict = SLICED) -> dict:
    config = tiny_config(model_type)
    reference = reference_run(config)
    chain = discover_blocks(build_hf_model(config), granularity="half")
    assert chain.granularity == "half" and len(chain.blocks) == 11, chain.notes
    aliases = {b: a for a, b in tied_parameters(build_hf_model(config), chain)}
    results = {"ref_loss": reference.loss, "ref_keys": sorted(reference.state),
               "ref_norm": math.sqrt(sum(g.pow(2).sum().item()
                                         for g in reference.grads.values()))}
    for key, counts in plans.items():
        schedule, _, variant = key.partition(":")
        blocks = planned_blocks(chain, units=sliced, vocab=2 if variant == "shards" else 0)
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=4, blocks=blocks)
        results[key] = exact_step(config, plan, reference, aliases, recompute, grad_norm=True)
    return results


def check_slices(results: list[dict], plans: dict) -> None:
    """``check_exact``, and every rank's gradient norm the reference's."""
    check_exact(results, plans, TOL)
    for key in plans:
        for r in results:
            assert r[key]["grad_norm"] == pytest.approx(r["ref_norm"], rel=1e-5), key


@pytest.mark.timeout(400)
def test_every_schedule_with_cuts_inside_halves_llama(tmp_path):
    """gpipe, 1F1B, interleaved, looped BFS, zero-bubble, ZBV, DualPipeV against the whole model."""
    check_slices(run_ranks(_worker, 2, tmp_path, "llama", EVERY_SCHEDULE, False),
                 EVERY_SCHEDULE)


@pytest.mark.timeout(240)
def test_recomputed_slices_train_exactly(tmp_path):
    """Checkpointed stages (a partial computation is checkpointed like its half), also
    under zero-bubble split backward."""
    check_slices(run_ranks(_worker, 2, tmp_path, "llama", RECOMPUTED, True), RECOMPUTED)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma", "mistral"])
def test_family_with_cuts_inside_halves(tmp_path, model_type):
    """1F1B cut inside an MLP and inside an attention (q/k/v biases, per-head q/k norms,
    sliding windows included)."""
    plans = {"1f1b": MLP_CUT, "1f1b:attention": ATTENTION_CUT}
    check_slices(run_ranks(_worker, 2, tmp_path, model_type, plans, False), plans)


@pytest.mark.timeout(240)
def test_a_fused_gate_up_mlp_cut_inside_trains_exactly(tmp_path):
    """Phi-3's MLP (one ``gate_up_proj``, chunked in its forward) cut into slices that each
    take their rows from both blocks; its attention (a fused ``qkv_proj``) stays whole.
    1F1B, and ZBV, whose split weight backward adds the two blocks' sparse rows."""
    sliced = {"model.layers.0.mlp": 4, "model.layers.2.mlp": 2}
    # names: 0 embedding, 1 L0 attention, 2-5 L0 MLP slices, 6 L1 attention, 7 L1 MLP,
    # 8 L2 attention, 9-10 L2 MLP slices, 11 L3 attention, 12 L3 MLP, 13 norm, 14 head
    plans = {"1f1b": [3, 12], "zbv": [3, 2, 5, 5]}
    check_slices(run_ranks(_worker, 2, tmp_path, "phi3", plans, False, sliced), plans)


def _planned_worker(rank: int, world_size: int, plan) -> dict:
    config = tiny_config("llama")
    reference = reference_run(config)
    aliases = {b: a for a, b in tied_parameters(
        build_hf_model(config), discover_blocks(build_hf_model(config), granularity="half"))}
    return {"ref_loss": reference.loss, "ref_keys": sorted(reference.state),
            "planned": exact_step(config, plan, reference, aliases, False)}


@pytest.mark.timeout(240)
def test_a_plan_from_the_planner_runs_exactly(tmp_path):
    """``make_plan`` with a cut named inside an MLP on a default cpu profile: the planner's
    slices and stage layout are what the runtime runs."""
    from autopart.profile import profile_model
    from autopart.solve import make_plan

    profile = profile_model(build_hf_model(tiny_config("llama")), backend="cpu",
                            seq_len=8, num_warmup=1, num_repeats=2)
    plan = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                     cuts=["model.layers.1.mlp.slice2of4"])
    assert plan.granularity == "slice" and plan.head_shards == 0
    assert plan.stages[0].held == plan.stages[1].held
    assert [h.module for h in plan.stages[0].held] == ["model.layers.1.mlp"]
    check_exact(run_ranks(_planned_worker, 2, tmp_path, plan), {"planned": None}, TOL)

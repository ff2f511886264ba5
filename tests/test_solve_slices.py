"""Planning with layer halves cut inside their call (``granularity="slice"``).

A synthetic ``half`` profile whose attention halves are a third of a layer: at
whole halves three stages cannot balance five layers, slices can. Checks the derived
slice costs, the whole half counted on both stages around a cut inside it (stage
cost, DP memory, a rank holding both), the gradient sum in the step, and the
``--cuts`` and ``auto`` paths.
"""

from __future__ import annotations

import dataclasses

import pytest
from solve_helpers import MIB, chain_of, half_of, make_block, make_profile

from autopart.cost.blocks import block_arrays
from autopart.cost.rank import rank_static_bytes, shared_grad_sync_ms
from autopart.cost.stage import stage_cost
from autopart.levels import CROSSING_TENSORS, at_level, slice_halves
from autopart.schema import Part, TrainingSetup
from autopart.solve import PlanOptions, make_plan
from autopart.solve.choices import Choice, choice_notes, choices
from autopart.solve.request import resolve_request


def halves_profile(num_layers: int = 5, units: dict | None = None):
    """embedding, (attention 1 ms, MLP 2 ms) per layer, norm, head; halves sliceable."""
    blocks = [make_block("model.embed_tokens", kind="embedding", fwd_ms=0.01,
                         num_params=1000, output_bytes=MIB)]
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        blocks.append(dataclasses.replace(make_block(
            f"{layer}.self_attn", kind="attention", fwd_ms=1.0, num_params=400_000,
            activation_bytes=8 * MIB, output_bytes=MIB, transient_bytes=2 * MIB),
            parts=half_of(layer, 0)))
        blocks.append(dataclasses.replace(make_block(
            f"{layer}.mlp", kind="mlp", fwd_ms=2.0, num_params=800_000,
            activation_bytes=16 * MIB, output_bytes=MIB, transient_bytes=4 * MIB),
            parts=half_of(layer, 1)))
    blocks.append(make_block("model.norm", kind="norm", fwd_ms=0.01, output_bytes=MIB))
    blocks.append(make_block("lm_head", kind="head", fwd_ms=0.5, num_params=1000,
                             output_bytes=4))
    profile = make_profile(blocks, name="halves")
    units = units or {"attention": 2, "mlp": 64}
    model = dataclasses.replace(profile.model, slice_units=units, slice_modules={
        "attention": "self_attn", "mlp": "mlp"})
    return dataclasses.replace(profile, model=model, setup=dataclasses.replace(
        profile.setup, granularity="half"))


def test_slices_share_the_half_by_units_and_send_three_hidden_states():
    profile = halves_profile()
    sliced = slice_halves(profile, 4)
    names = [b.name for b in sliced.blocks]
    assert names[1:3] == [f"model.layers.0.self_attn.slice{i}of2" for i in range(2)]
    assert names[3:7] == [f"model.layers.0.mlp.slice{i}of4" for i in range(4)]
    mlp = sliced.blocks[3:7]
    assert sum(b.fwd_ms for b in mlp) == pytest.approx(2.0)
    assert sum(b.num_params for b in mlp) == 800_000
    assert sum(b.activation_bytes for b in mlp) == 16 * MIB
    assert [b.output_bytes for b in mlp] == [CROSSING_TENSORS * MIB] * 3 + [MIB]
    assert mlp[1].parts == (*half_of("model.layers.0", 1),
                            Part(module="model.layers.0.mlp", axis="units", index=1, count=4))
    assert sliced.setup.granularity == "slice"


def _choices(profile, **options):
    return choices(profile, resolve_request(profile, PlanOptions(pp_size=2, **options)))


def test_granularity_slice_notes_and_profiles_without_units():
    sliced = at_level(halves_profile(), "slice")
    assert len(sliced.blocks) == 1 + 5 * (2 + 4) + 2
    (note,) = choice_notes(halves_profile(), Choice("slice", 0, 4))
    assert "attention into 2 KV-head groups, mlp into 4 column groups" in note
    assert _choices(halves_profile()) == ([Choice("half"), Choice("slice", 0, 4)], [])
    plain = halves_profile(units={"attention": 2})
    plain = dataclasses.replace(plain, model=dataclasses.replace(plain.model, slice_units={}))
    assert at_level(plain, "slice").blocks == plain.blocks
    found, notes = _choices(plain, granularity="slice")
    assert found == [Choice("half")] and "no half of this profile can be cut" in notes[0]
    found, notes = _choices(halves_profile(), granularity="slice", target="nxd")
    assert found == [Choice("layer")] and "layer granularity" in notes[0]


def test_a_stage_holds_the_halves_it_starts_or_ends_inside_whole():
    setup = TrainingSetup(pp_size=2, num_microbatches=4)
    sliced = slice_halves(halves_profile(), 4)
    arrays = block_arrays(sliced, setup)
    whole_mlp = round(800_000 * arrays.static_bytes[3] / arrays.num_params[3])
    first = stage_cost(arrays, 0, 4)  # ends after mlp.slice1of4 of layer 0
    second = stage_cost(arrays, 5, len(sliced.blocks) - 1)  # starts at mlp.slice2of4
    ((module, held),) = first.held
    assert module == "model.layers.0.mlp" and held == pytest.approx(whole_mlp, rel=1e-6)
    assert second.held[0] == first.held[0]
    whole = stage_cost(arrays, 0, len(sliced.blocks) - 1)
    # both hold the MLP whole: together they count it once more than the whole chain
    assert first.static_bytes + second.static_bytes == pytest.approx(
        whole.static_bytes + held, rel=1e-6)
    assert first.param_count == 1000 + 400_000 + 800_000
    # the DP's memory uses the same static bytes
    chain = chain_of(sliced, setup)
    assert chain.static_ends[1][5] - chain.static_ends[0][0] == first.static_bytes
    assert chain.static_ends[1][len(sliced.blocks)] - chain.static_ends[0][5] == \
        second.static_bytes
    # one rank holding both stages (a V schedule's turn) holds the half once
    both = rank_static_bytes([first, second], [0, 1])
    assert both == whole.static_bytes
    # two ranks sum the half's gradient after the step
    sync = shared_grad_sync_ms([first, second], [0, 1], setup)
    assert sync > 0 and shared_grad_sync_ms([first, second], [0, 0], setup) == 0


def test_slices_balance_what_whole_halves_cannot():
    profile = halves_profile()
    args = dict(pp_size=3, schedule="1f1b", num_microbatches=12,
                link_bandwidth_bytes_per_s=1e12, link_latency_ms=0.0)
    halves = make_plan(profile, granularity="half", **args)
    sliced = make_plan(profile, granularity="slice", **args)
    assert sliced.predicted_step_ms < 0.97 * halves.predicted_step_ms
    assert any(".slice" in c for c in sliced.pipeline_cuts)
    assert sliced.granularity == "slice" and halves.granularity == "half"
    auto = make_plan(profile, **args)
    assert auto.pipeline_cuts == sliced.pipeline_cuts and auto.granularity == "slice"


def test_auto_keeps_halves_whole_when_the_gradient_sum_costs_more():
    profile = halves_profile()
    slow = dict(pp_size=3, schedule="1f1b", num_microbatches=12,
                link_bandwidth_bytes_per_s=1e6, link_latency_ms=0.0)
    auto = make_plan(profile, **slow)
    assert not any(".slice" in c for c in auto.pipeline_cuts) and auto.granularity == "half"
    assert any(n.startswith("granularity: half, head whole chosen; also predicted: slice")
               and "slices kept only when 1% faster" in n for n in auto.notes)


def test_cuts_name_slices():
    profile = halves_profile()
    plan = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                     cuts=["model.layers.2.mlp.slice1of4"])
    assert plan.pipeline_cuts == ("model.layers.2.mlp.slice1of4",)
    assert plan.stages[0].held == plan.stages[1].held
    assert plan.stages[0].held[0].module == "model.layers.2.mlp"
    assert plan.stages[1].modules[0] == "model.layers.2.mlp.slice2of4"
    at_the_end = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                           cuts=["model.layers.2.mlp.slice3of4"])
    assert at_the_end.pipeline_cuts == ("model.layers.2",)  # the shortest name of that cut


def test_the_plan_table_shows_slices_as_ranges_and_whole_halves_as_layers():
    from cli._format import summarize_modules

    sliced = slice_halves(halves_profile(), 4)
    parts = {b.name: b.parts for b in sliced.blocks if b.parts}
    names = [b.name for b in sliced.blocks]
    assert summarize_modules(names[:1 + 3 * 6 + 1], parts) == (
        "model.embed_tokens, model.layers.0-2, model.layers.3.self_attn.slice0of2")
    assert summarize_modules(names[1 + 3 * 6 + 3:1 + 4 * 6 + 2], parts) == (
        "model.layers.3.mlp.slice1-3of4, model.layers.4.self_attn")
    shards = [(f"lm_head.shard{i}of4", (Part(module="lm_head", axis="vocab", index=i,
                                               count=4),)) for i in range(4)]
    assert summarize_modules([n for n, _ in shards[:2]], dict(shards)) == "lm_head.shard0-1of4"
    assert summarize_modules([n for n, _ in shards], dict(shards)) == "lm_head"


@pytest.mark.parametrize("cut", ["model.layers.2.mlp.slice1of99999",
                                 "model.layers.9.mlp.slice1of4"])
def test_cuts_naming_slices_that_do_not_exist_say_why(cut):
    from autopart.errors import PlanError

    with pytest.raises(PlanError, match="slices exist where the profile offers them"):
        make_plan(halves_profile(), pp_size=2, schedule="1f1b", num_microbatches=4, cuts=[cut])


def test_a_sliced_or_sharded_plan_names_its_cuts_so_they_replan_to_the_same_split():
    """The point after a slice or head shard that is not the last is not the end of its
    module's call: the module's name names the point after its last part only, so a plan's
    ``pipeline_cuts`` fed back as ``cuts`` give the same stages."""
    from families import tiny_config

    from autopart.intake.sources import build_hf_model
    from autopart.profile import profile_model
    from autopart.solve.cuts import boundary_names

    profile = profile_model(build_hf_model(tiny_config("llama")), backend="analytical:h100",
                            seq_len=64)
    sliced = at_level(profile, "slice", head_shards=4)
    names = boundary_names(sliced.blocks)
    ends = {b.name: j for j, b in enumerate(sliced.blocks, 1)}
    assert names["model.layers.0.mlp"] == ends["model.layers.0.mlp.slice3of4"]
    assert "lm_head" not in names
    for cuts in (["model.layers.0.mlp.slice1of4"], ["model.layers.1.self_attn.slice0of2"]):
        plan = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b", cuts=cuts)
        again = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b",
                          cuts=list(plan.pipeline_cuts))
        assert list(plan.pipeline_cuts) == cuts
        assert [s.modules for s in again.stages] == [s.modules for s in plan.stages]


def test_cuts_naming_attention_slices_of_two_beside_mlp_slices_of_four_replan():
    """With 2 KV heads an attention half is cut into 2 slices where an MLP half is cut
    into 4, so one plan names both K; its ``pipeline_cuts`` fed back give the same stages
    (they were refused: "all slice names must agree on K")."""
    profile = halves_profile()
    cuts = ["model.layers.1.self_attn.slice0of2", "model.layers.3.mlp.slice1of4"]
    plan = make_plan(profile, pp_size=3, num_microbatches=6, schedule="1f1b", cuts=cuts)
    assert list(plan.pipeline_cuts) == cuts
    again = make_plan(profile, pp_size=3, num_microbatches=6, schedule="1f1b",
                      cuts=list(plan.pipeline_cuts))
    assert [s.modules for s in again.stages] == [s.modules for s in plan.stages]

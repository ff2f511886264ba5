"""Head shards as plan blocks, --granularity and --cuts: hand-worked costs and one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
from solve_helpers import llama_like

from autopart.cost.blocks import block_arrays
from autopart.cost.stage import stage_cost
from autopart.errors import PlanError
from autopart.levels import num_shards, split_head
from autopart.schema import Part, TrainingSetup
from autopart.solve import PlanOptions, make_plan, plan_again
from autopart.solve.baselines import baseline_split
from autopart.solve.choices import Choice, choices
from autopart.solve.cuts import cut_bounds
from autopart.solve.request import resolve_request
from cli.main import main


def _splittable(num_layers: int = 4, head_ms: float = 6.0, rows: int = 1000):
    profile = llama_like(num_layers, head_ms=head_ms)
    return dataclasses.replace(profile, model=dataclasses.replace(profile.model,
                                                                  head_split_rows=rows))


def test_shards_share_the_head_cost_by_vocabulary_fraction():
    """4 shards of 1000 rows: 250 each, so F = head F / 4; the carry crosses every cut but
    the last (hidden + 2 float32 per position), the last shard outputs the head's output."""
    profile = _splittable()
    head, norm = profile.blocks[-1], profile.blocks[-2]
    split = split_head(profile, 4)
    shards = split.blocks[-4:]
    assert [b.name for b in shards] == [f"lm_head.shard{i}of4" for i in range(4)]
    assert [b.parts for b in shards] == [
        (Part(module="lm_head", axis="vocab", index=i, count=4),) for i in range(4)]
    assert all(b.fwd_ms == pytest.approx(head.fwd_ms / 4) for b in shards)
    assert sum(b.bwd_weight_ms for b in shards) == pytest.approx(head.bwd_weight_ms)
    carry = 2 * 4 * profile.setup.micro_batch_size * (profile.setup.seq_len - 1)
    assert [b.output_bytes for b in shards] == [norm.output_bytes + carry] * 3 + [4]
    assert sum(b.num_params for b in shards) == head.num_params
    assert split.blocks[:-4] == profile.blocks[:-1]


def test_num_shards_makes_a_shard_a_quarter_layer():
    """head 6 ms F + 12 ms B against a 3 ms layer: ceil(4 * 18 / 3) = 24 shards."""
    assert num_shards(_splittable(head_ms=6.0)) == 24
    assert num_shards(_splittable(head_ms=0.2)) == 2  # at least two
    assert num_shards(_splittable(head_ms=600.0)) == 64  # at most 64


def _choices(profile, **options):
    return choices(profile, resolve_request(profile, PlanOptions(pp_size=2, **options)))


def test_granularity_layer_and_targets_keep_the_head_whole():
    """``auto`` tries the head in 24 shards and whole; the layer level and an export
    target keep it whole (the target says why); a head that cannot be split stays whole."""
    profile = _splittable()
    assert _choices(profile) == ([Choice("layer", 24), Choice("layer", 0)], [])
    assert _choices(profile, granularity="layer") == ([Choice("layer", 0)], [])
    assert _choices(profile, target="nxd") == ([Choice("layer")], [
        "nxd cannot express cuts inside a layer or the head: planned at layer granularity"])
    assert _choices(llama_like(4)) == ([Choice("layer", 0)], [])
    assert _choices(profile, split_head=False) == ([Choice("layer", 0)], [])
    with pytest.raises(PlanError, match="unknown granularity"):
        PlanOptions(pp_size=2, granularity="fine")


def test_baselines_keep_the_split_head_whole():
    """The public tools' splits of the split profile are those of the whole-head profile."""
    profile = _splittable()
    split = split_head(profile, 4)
    for name in ("even", "params", "torchtitan"):
        whole = baseline_split(name, profile.blocks, 3)
        got = baseline_split(name, split.blocks, 3)
        assert got[:-1] == whole[:-1] and got[-1] == (whole[-1][0], len(split.blocks)), name


def test_auto_granularity_beats_whole_layers_on_a_heavy_head():
    """4 layers of F 1 + B 2 ms and a head of F 6 + B 12 ms on 2 ranks, 1F1B, m 4.
    Whole blocks: rank 0 F 4.12 / B 8.24 ms, rank 1 the head: step = 4.12 + 4 * 18 + 8.24
    = 84.36 ms. 24 shards of 0.75 ms: four join rank 0 (F 5.12 / B 10.24, 15.36 ms a
    microbatch, rank 1 15 ms): step = 4 * 15.36 + 15 = 76.44 ms."""
    profile = _splittable()
    kwargs = {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 4}
    layer = make_plan(profile, granularity="layer", **kwargs)
    auto = make_plan(profile, **kwargs)
    assert layer.predicted_step_ms == pytest.approx(84.36, rel=0.01)
    assert auto.predicted_step_ms == pytest.approx(76.44, rel=0.01)
    assert auto.pipeline_cuts == ("lm_head.shard3of24",)
    assert auto.granularity == layer.granularity == "layer"
    assert (auto.head_shards, layer.head_shards) == (24, 0)
    assert auto.parts["lm_head.shard3of24"] == (
        Part(module="lm_head", axis="vocab", index=3, count=24),)


def test_cuts_are_evaluated_as_given():
    profile = _splittable()
    plan = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                     cuts=["lm_head.shard5of24"])
    assert plan.pipeline_cuts == ("lm_head.shard5of24",)
    assert plan.solver.name == "cuts" and plan.virtual_stages == 1
    four = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                     cuts=["lm_head.shard1of4"])  # the cut's K sets the number of shards
    assert four.stages[1].modules == ("lm_head.shard2of4", "lm_head.shard3of4")
    assert cut_bounds(profile, ["model.layers.1", "model.layers.3"], 3, "auto") == (
        ((0, 3), (3, 5), (5, 7)), 1)


def test_cuts_without_shards_keep_a_split_head_split_on_the_last_stage():
    """A plan whose shards are all on its last stage names none in its cuts (the even
    split, as the rehearsal runs it): planned again it keeps them, as ``--head split
    --cuts`` does, and its stages cost the same; before, the head came back whole and the
    rehearsal priced the posts of its Interleaved and GPipe runs on another plan.
    Shards named with the head to stay whole are refused."""
    profile = _splittable()
    even = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                     partition="even", split_head=True)
    assert even.head_shards and not any(".shard" in c for c in even.pipeline_cuts)
    again = plan_again(profile, even)
    assert again.head_shards and again.stages[1].modules[-1].startswith("lm_head.shard")
    assert [s.fwd_ms for s in again.stages] == pytest.approx([s.fwd_ms for s in even.stages])
    whole = make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                      cuts=even.pipeline_cuts)
    assert not whole.head_shards
    with pytest.raises(PlanError, match="name no shard, or drop --head whole"):
        make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4,
                  cuts=["lm_head.shard1of4"], split_head=False)


@pytest.mark.parametrize("cuts, message", [
    (["model.layers.9"], "not a cut of the profile: no module of the profile has that name"),
    (["lm_head.shard1of4"], "head shards where the head can be split"),
    (["model.layers.3", "model.layers.1", "model.norm"], "must follow model order"),
    (["model.layers.1", "model.layers.2"], "expected pp * v - 1 (1, 3, ... for pp 2)"),
    (["lm_head"], "the end of the model"),
])
def test_bad_cuts_are_refused(cuts, message):
    profile = llama_like(4)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*").replace(".", r"\.")):
        cut_bounds(profile, cuts, 2, "auto")


def test_cuts_count_against_given_virtual_stages():
    with pytest.raises(PlanError, match=r"expected pp \* v - 1 = 3 for pp 2, v 2"):
        cut_bounds(llama_like(4), ["model.layers.1"], 2, 2)


@pytest.mark.parametrize("cuts, message", [
    ("model.layers.9", "--cuts names 'model.layers.9', which is not a cut"),
    ("model.layers.3,model.layers.1,model.norm", "--cuts must follow model order"),
    ("model.layers.1,model.layers.2", "--cuts gives 2 cut(s) (3 stages), expected"),
    ("model.layers.1,", "has an empty name"),
])
def test_cli_cuts_errors_are_one_line(tmp_path, capsys, cuts, message):
    path = tmp_path / "p.json"
    path.write_text(llama_like(4).to_json())
    assert main(["plan", str(path), "--pp", "2", "--cuts", cuts]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and message in err, err


def test_a_shard_holds_its_rows_fraction_of_the_sliced_loss_memory():
    """Shards run the runtime's sliced loss, not the measured head's (whatever its
    workspace, here 12,345 bytes): mbs 1 x 15 positions, hidden 16,384 (fp32), 1000 rows.
    Held: the log-softmax, 15 x 1000 x 4 = 60,000 bytes; workspace: the rows' weight
    gradient and the input's, (1000 + 15) x 16,384 x 4 = 66,519,040 bytes (more than the
    softmax buffer, 60,000); 333, 333 and 334 rows take their fraction of both (rounded
    at both ends); the parameters split exactly."""
    profile = _splittable(rows=1000)
    profile = dataclasses.replace(profile, blocks=(*profile.blocks[:-1], dataclasses.replace(
        profile.blocks[-1], transient_bytes=12_345)))
    head = profile.blocks[-1]
    assert head.param_bytes > 0
    shards = split_head(profile, 3).blocks[-3:]
    assert [b.activation_bytes for b in shards] == [19_980, 19_980, 20_040]
    assert [b.transient_bytes for b in shards] == [22_150_840, 22_150_841, 22_217_359]
    assert sum(b.transient_bytes for b in shards) == 66_519_040
    assert sum(b.num_params for b in shards) == head.num_params
    assert sum(b.param_bytes for b in shards) == head.param_bytes


def test_a_stage_runs_its_shards_as_one_slice_and_returns_token_losses():
    """4 shards of 1000 rows (workspace 66,519,040 bytes in all, 16,629,760 each): a
    stage of the last three runs their rows as one slice, so its workspace is three
    shards' (not the largest shard's); the last stage holds per-position losses until its
    backward (mbs 1 x seq - 1 float32), not the logits the whole head returns."""
    profile = _splittable(rows=1000)
    profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, vocab_size=1000),
        blocks=(*profile.blocks[:-1], dataclasses.replace(profile.blocks[-1],
                                                          transient_bytes=12_345)))
    split = split_head(profile, 4)
    setup = profile.setup
    arrays = block_arrays(split, TrainingSetup(pp_size=2, num_microbatches=4))
    n = len(split.blocks)
    assert stage_cost(arrays, n - 3, n - 1).transient_bytes == 3 * 16_629_760
    assert stage_cost(arrays, n - 1, n - 1).transient_bytes == 16_629_760
    losses = setup.micro_batch_size * (setup.seq_len - 1) * 4
    assert arrays.held_output_bytes[-1] == losses
    assert stage_cost(arrays, n - 1, n - 1).activation_bytes == (  # its input is the buffer's
        split.blocks[-1].activation_bytes + losses)
    whole = block_arrays(profile, TrainingSetup(pp_size=2, num_microbatches=4))
    assert whole.held_output_bytes[-1] == (setup.micro_batch_size * setup.seq_len
                                           * profile.model.vocab_size * 4)


def test_auto_keeps_the_head_whole_when_the_gradient_zero_fill_costs_more():
    """The plan of test_auto_granularity_beats_whole_layers_on_a_heavy_head, but every
    rank with shards zero-fills the head's gradient in 20 ms per step (5 ms in each of the
    4 microbatches' F): shards on both ranks give rank 0 15.36 + 5 ms a microbatch
    (4 * 20.36 + 20 = 101.4 ms), all on rank 1 the whole head + 5 ms, so the split
    cannot win (whole: 84.36 ms) and auto keeps the head whole with a note."""
    profile = _splittable()
    slow = dataclasses.replace(profile, setup=dataclasses.replace(profile.setup,
                                                                  head_grad_ms=20.0))
    kwargs = {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 4}
    plan = make_plan(slow, **kwargs)
    assert plan.predicted_step_ms == pytest.approx(84.36, rel=0.01)
    assert plan.pipeline_cuts == make_plan(profile, granularity="layer", **kwargs).pipeline_cuts
    assert plan.head_shards == 0
    assert any(n.startswith("granularity: layer, head whole chosen; also predicted: layer, "
                            "head in 24 shards") for n in plan.notes)
    fast = dataclasses.replace(profile, setup=dataclasses.replace(profile.setup,
                                                                  head_grad_ms=0.01))
    assert make_plan(fast, **kwargs).pipeline_cuts == ("lm_head.shard3of24",)


def test_choices_skip_configurations_that_need_more_blocks_than_they_have():
    """The head split into 24 shards allows more stages than the 7 whole blocks: the
    head-whole choice is searched over the configurations that fit its blocks (found by
    the plan fuzz: 'num_stages (24) must be in 1..19')."""
    plan = make_plan(_splittable(), pp_size=3, schedule="interleaved-1f1b",
                     num_microbatches=6)
    assert plan.virtual_stages * 3 <= len(plan.stages)
    assert any(n.startswith("granularity: layer, head in 24 shards chosen") for n in plan.notes)


def test_a_cut_inside_a_block_names_the_cuts_there():
    """A name whose call ends inside a block (a layer's attention half on a profile of
    whole layers) says where cuts are and how to get finer ones; found by the plan fuzz
    ('no module of the profile has that name' for model.layers.2.self_attn.o_proj)."""
    with pytest.raises(PlanError, match=r"model.layers.2.self_attn.o_proj', which is not a cut "
                                        r"of the profile: its call ends inside a block at the "
                                        r"layer level \(cuts there: model.layers.2\)"):
        cut_bounds(llama_like(4), ["model.layers.2.self_attn.o_proj"], 2, "auto")


def test_the_ilp_second_opinion_skips_a_chain_cut_inside_the_head(monkeypatch):
    """``solver="auto"`` asks the ILP on the coarsest chain, but not where that chain cuts
    between vocabulary shards: identical shards make the MIP symmetric (tiny-llama at pp 8
    under Interleaved 1F1B: 10-25 s a solve for the plan the DP found alone in 7 s). The
    whole-head chain still gets it, and the plan is the one without the ILP on shards."""
    from autopart.solve import propose

    asked = []
    real = propose.propose_ilp

    def spy(setting, config, options, chain=None, starts=None):
        blocks = setting.profile.blocks
        asked.append(sum(1 for i in starts[:-1] if blocks[i].parts))  # blocks from shards
        return real(setting, config, options, chain, starts)

    monkeypatch.setattr(propose, "propose_ilp", spy)
    kwargs = {"schedule": "interleaved-1f1b", "num_microbatches": 16}
    make_plan(_splittable(), pp_size=2, **kwargs)
    assert asked and max(asked) <= 1, asked  # whole layers, the head whole: one block
    asked.clear()  # 8 ranks: whole layers are too few, the coarsest chain has the shards
    plan = make_plan(_splittable(), pp_size=8, **kwargs)
    assert asked == [], asked
    assert plan.head_shards and plan.predicted_step_ms == make_plan(
        _splittable(), pp_size=8, solver="dp", **kwargs).predicted_step_ms


def test_a_choice_with_too_few_blocks_for_the_stages_is_passed_over():
    """4 layers on 8 ranks: with the head whole the model has 7 blocks, in 24 shards 30.
    ``auto`` plans the shards; it used to refuse the whole request because the head-whole
    choice, tried second, could not host 8 stages ("pp_size (8) exceeds the number of
    blocks (7) ... plan at a finer level", while planning at the finest). With the head
    kept whole the refusal stays, in one line; where no choice has enough blocks, it names
    the most any has (30, the shards'), not the first choice's count (it named 7 for 31
    stages, and a plan of 30 stages ran)."""
    plan = make_plan(_splittable(), pp_size=8, schedule="1f1b", num_microbatches=8)
    assert plan.head_shards == 24 and len(plan.stages) == 8
    with pytest.raises(PlanError, match=r"pp_size \(8\) exceeds the number of blocks of "
                       r"'.*' at its finest cuts the options allow \(7: layer, head whole\); "
                       r"lower --pp to at most 7 stages"):
        make_plan(_splittable(), pp_size=8, schedule="1f1b", num_microbatches=8,
                  split_head=False)
    assert len(make_plan(_splittable(), pp_size=30, schedule="1f1b", num_microbatches=30,
                         solver="dp").stages) == 30
    with pytest.raises(PlanError, match=r"pp_size \(31\) .* \(30: layer, head in 24 shards\)"):
        make_plan(_splittable(), pp_size=31, schedule="1f1b", num_microbatches=31)
    with pytest.raises(PlanError, match=r"pp_size \* virtual_stages \(8 \* 4\) .* \(30: "
                       r"layer, head in 24 shards\); lower --pp or --virtual-stages"):
        make_plan(_splittable(), pp_size=8, schedule="interleaved-1f1b", virtual_stages=4,
                  num_microbatches=8)

"""Files of schema 1 (parts carried in names, ``layer``, levels ``sublayer`` / ``quarter``)
load as schema 2 with the same meaning: written by autopart at commit f445ebb
(``tests/data/schema1``). A replayed plan predicts what it predicted then, and the runtime
finds the parts it names; other versions get one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopart.errors import SchemaError
from autopart.intake import discover_blocks, load_model
from autopart.profile import profile_model
from autopart.runtime.builder import chain_for_plan
from autopart.runtime.validate import check_parts
from autopart.schema import HeldModule, Part, Plan, Profile
from autopart.simulate import simulate_plan

DATA = Path(__file__).parent / "data" / "schema1"


def _old(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def test_a_quarter_profile_loads_at_the_projection_level_with_typed_parts():
    old = Profile.load(DATA / "profile_quarter.json")
    new = profile_model("tiny-llama", backend="analytical:h100", seq_len=16)
    assert old.schema_version == 2 and old.setup.granularity == "projection"
    assert [(b.name, b.kind, b.parts) for b in old.blocks] == [
        (b.name, b.kind, b.parts) for b in new.blocks]
    assert old.model.slice_modules == {"attention": "self_attn", "mlp": "mlp"}
    tied = Profile.load(DATA / "profile_sublayer_tied.json")
    assert tied.setup.granularity == "half"
    assert tied.blocks[2].parts == (Part(module="model.layers.0", axis="calls", index=1,
                                         count=2),)


@pytest.mark.parametrize(("name", "level", "shards"), [
    ("plan_slice", "slice", 16), ("plan_shards", "projection", 4),
    ("plan_tied_shards", "half", 4)])
def test_plans_replay_what_they_predicted(name, level, shards):
    """The held modules (schema 1: tied_* and shared_half_bytes) give each rank the same
    static memory and the step the same gradient sums."""
    old = _old(name)
    plan = Plan.load(DATA / f"{name}.json")
    assert (plan.granularity, plan.head_shards) == (level, shards)
    result = simulate_plan(plan)
    assert result.step_ms == pytest.approx(old["predicted_step_ms"], rel=1e-12)
    assert list(result.rank_peak_memory_bytes) == [r["peak_memory_bytes"] for r in old["ranks"]]
    assert plan.parts[f"lm_head.shard1of{shards}"] == (
        Part(module="lm_head", axis="vocab", index=1, count=shards),)


def test_a_slice_plan_holds_its_half_on_both_stages_and_runs_here():
    plan = Plan.load(DATA / "plan_slice.json")
    held = HeldModule(module="model.layers.1.mlp", static_bytes=541696)
    assert held in plan.stages[0].held and held in plan.stages[1].held
    model = load_model("tiny-llama").model
    chain = chain_for_plan(model, discover_blocks(model), plan)
    found = check_parts(plan, chain, model, has_loss_fn=False)
    cut = [d.stage for d in found if d.part.module == "model.layers.1.mlp"]
    assert cut == [0, 0, 1, 1]  # the cut after slice 1 of 4


@pytest.mark.parametrize("version", [0, 3, "1"])
def test_other_versions_get_one_line(tmp_path, version):
    data = {**_old("plan_shards"), "schema_version": version}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=f"plan schema_version {version!r}, this autopart "
                                          f"reads 2; regenerate it with `autopart plan`"):
        Plan.load(path)

"""Data contracts: JSON round trips, loader errors, cost arithmetic, stage-to-rank mapping.

Compared against hand-computed values and torch's own stage-to-rank mapping.
"""

from __future__ import annotations

import json

import pytest

from autopart.cost.blocks import block_arrays, static_bytes_per_param
from autopart.cost.stage import comm_ms, stage_cost
from autopart.errors import PlanError, SchemaError
from autopart.schedules import SCHEDULES, check_schedule, stage_to_rank, stages_of_rank
from autopart.schema import (
    BaselineResult,
    BlockProfile,
    ModelInfo,
    Plan,
    Profile,
    ProfileSetup,
    RankPlan,
    SolverInfo,
    StagePlan,
    TrainingSetup,
    precision_fields,
    setup_fields_with_precision,
)


def _block(name: str, fwd: float, act: int, out: int, params: int) -> BlockProfile:
    return BlockProfile(name=name, kind="block", fwd_ms=fwd, bwd_ms=2 * fwd,
                        bwd_input_ms=fwd, bwd_weight_ms=fwd, param_bytes=4 * params,
                        activation_bytes=act, output_bytes=out, transient_bytes=act // 2,
                        num_params=params)


def _profile() -> Profile:
    blocks = (_block("a", 1.0, 100, 10, 5), _block("b", 2.0, 200, 20, 7),
              _block("c", 3.0, 300, 30, 11))
    return Profile(model=ModelInfo(name="m", fingerprint="f", num_params=23),
                   setup=ProfileSetup(backend="cpu", device_name="cpu", dtype="float32",
                                      micro_batch_size=1, seq_len=8, torch_version="x"),
                   blocks=blocks)


def test_profile_round_trip_is_exact_and_sorted():
    profile = _profile()
    text = profile.to_json()
    assert Profile.from_json(text) == profile
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


def test_profile_loader_names_file_and_missing_key(tmp_path):
    data = json.loads(_profile().to_json())
    del data["blocks"][1]["output_bytes"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=r"p\.json is missing key 'blocks\[1\]\.output_bytes'"):
        Profile.load(path)


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a profile object"),
    ('{"schema_version": 99}', "schema_version 99"),
])
def test_profile_loader_rejects_bad_files(text, message):
    with pytest.raises(SchemaError, match=message):
        Profile.from_json(text, "x.json")


def test_missing_file_is_a_schema_error(tmp_path):
    with pytest.raises(SchemaError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")


def _two_stage_plan() -> Plan:
    stages = tuple(StagePlan(index=i, rank=i, modules=(n,), fwd_ms=1.0, bwd_ms=2.0,
                             param_count=3) for i, n in enumerate("ab"))
    ranks = tuple(RankPlan(rank=i, stages=(i,), peak_memory_bytes=10, busy_ms=3.0)
                  for i in range(2))
    return Plan(profile_fingerprint="f", pp_size=2, virtual_stages=1, schedule="1f1b",
                num_microbatches=4, pipeline_cuts=("a",), stages=stages, ranks=ranks,
                predicted_step_ms=9.0, bubble_fraction=0.2,
                setup=TrainingSetup(pp_size=2, num_microbatches=4, optimizer="sgd"),
                baselines={"even": BaselineResult(predicted_step_ms=9.0, speedup=1.0, fits=True,
                                                  peak_memory_bytes=10,
                                                  stage_num_blocks=(1, 1))},
                solver=SolverInfo(name="dp", status="optimal", objective_ms=8.5))


def test_plan_round_trip():
    plan = _two_stage_plan()
    assert Plan.from_json(plan.to_json()) == plan
    broken = json.loads(plan.to_json())
    broken["pipeline_cuts"] = []
    with pytest.raises(SchemaError, match="inconsistent"):
        Plan.from_json(json.dumps(broken), "plan.json")


def test_plans_without_a_mesh_load_as_tp1_dp1():
    """Plans written before the mesh fields existed still load, as one replica, no TP."""
    data = json.loads(_two_stage_plan().to_json())
    for key in ("tp_size", "dp_size", "zero_stage", "sequence_parallel",
                "reshard_after_forward"):
        del data[key]
    del data["setup"]["reshard_after_forward"]
    plan = Plan.from_json(json.dumps(data), "old.json")
    assert (plan.tp_size, plan.dp_size, plan.zero_stage) == (1, 1, 0)
    assert plan.sequence_parallel and not plan.reshard_after_forward


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(pipeline_cuts=[]), r"0 pipeline cut\(s\) for 2 stages, expected 1"),
    (lambda d: d.update(pp_size=4), r"2 stage\(s\), expected pp_size x virtual_stages"),
    (lambda d: d["stages"][1].update(rank=5), r"stage\(s\) \[1\] on ranks outside 0..1"),
    (lambda d: d.update(num_microbatches=0), "num_microbatches must be an integer >= 1"),
    (lambda d: d.update(tp_size=0), "tp_size must be an integer >= 1"),
    (lambda d: d.update(dp_size=1.5), "dp_size"),
    (lambda d: d.update(zero_stage=2), r"zero_stage must be one of \(0, 1, 3\)"),
    (lambda d: d.update(reshard_after_forward=True), "reshard_after_forward needs zero_stage 3"),
])
def test_inconsistent_plan_files_are_schema_errors(edit, message):
    data = json.loads(_two_stage_plan().to_json())
    edit(data)
    with pytest.raises(SchemaError, match=message):
        Plan.from_json(json.dumps(data), "plan.json")


def test_python_O_still_refuses_a_plan_without_cuts(tmp_path):
    """Under ``python -O`` asserts vanish; the plan checks must not."""
    import subprocess
    import sys

    data = json.loads(_two_stage_plan().to_json())
    data["pipeline_cuts"] = []
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code = ("import sys; from autopart.schema import Plan; from autopart.errors import "
            "SchemaError\ntry:\n    Plan.load(sys.argv[1])\nexcept SchemaError as e:\n"
            "    print(e); sys.exit(3)")
    result = subprocess.run([sys.executable, "-O", "-c", code, str(path)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 3, result.stderr
    assert "0 pipeline cut(s) for 2 stages" in result.stdout


def test_static_bytes_per_param():
    assert static_bytes_per_param(TrainingSetup(pp_size=1, num_microbatches=1)) == 16
    mixed = TrainingSetup(pp_size=1, num_microbatches=1, param_dtype="bfloat16",
                          grad_dtype="bfloat16", master_weights=True)
    assert static_bytes_per_param(mixed) == 2 + 2 + 8 + 4
    sgd = TrainingSetup(pp_size=1, num_microbatches=1, optimizer="sgd")
    assert static_bytes_per_param(sgd) == 12


@pytest.mark.parametrize(("precision", "per_param"), [
    ("fp32", 4 + 4 + 8), ("bf16", 2 + 2 + 2 * 2), ("fp16", 2 + 2 + 2 * 2),
    ("bf16-mixed", 2 + 4 + 4 + 8), ("fp16-mixed", 2 + 4 + 4 + 8)])
def test_precision_presets_give_the_documented_bytes(precision, per_param):
    """Hand-counted: params + grads + Adam's two states (+ fp32 master weights)."""
    setup = TrainingSetup(pp_size=1, num_microbatches=1, **precision_fields(precision))
    assert static_bytes_per_param(setup) == per_param
    assert setup.precision == precision


def test_precision_defaults_to_the_profile_dtype():
    """A bf16 profile gets torch AdamW on bf16 parameters (8 B), not the old 12 B."""
    fields = setup_fields_with_precision({"optimizer": "adam"}, "bfloat16")
    assert static_bytes_per_param(TrainingSetup(pp_size=1, num_microbatches=1, **fields)) == 8
    assert setup_fields_with_precision({}, "float32") == precision_fields("fp32")
    explicit = setup_fields_with_precision({"param_dtype": "bfloat16"}, "float32")
    assert explicit == {"param_dtype": "bfloat16"}
    with pytest.raises(SchemaError, match="do not also give param_dtype"):
        setup_fields_with_precision({"precision": "bf16", "param_dtype": "float32"}, "float32")
    with pytest.raises(SchemaError, match="precision 'int8'"):
        precision_fields("int8")


def test_stage_cost_sums_blocks_and_boundaries():
    setup = TrainingSetup(pp_size=2, num_microbatches=4, optimizer="none")
    arrays = block_arrays(_profile(), setup)
    cost = stage_cost(arrays, 1, 2)
    assert (cost.fwd_ms, cost.bwd_ms) == (5.0, 10.0)
    # saved 200 + 300, + c's output held until the backward (30), - b's saved input,
    # which lives in torch's receive buffer (10)
    assert cost.activation_bytes == 200 + 300 + 30 - 10
    assert (cost.input_bytes, cost.output_bytes) == (10, 0)
    assert cost.static_bytes == 18 * 8  # params + grads, fp32
    assert cost.transient_bytes == 150
    assert arrays.stage_time_ms(1, 2) == 15.0


def test_recompute_keeps_only_block_inputs():
    setup = TrainingSetup(pp_size=2, num_microbatches=4)
    cost = stage_cost(block_arrays(_profile(), setup), 1, 2, recompute=True)
    # inputs of blocks b and c, + the held output of c, - b's input (the receive buffer)
    assert cost.activation_bytes == 10 + 20 + 30 - 10
    assert cost.bwd_input_ms == 5.0 + 5.0  # B plus the recomputed forward
    assert cost.transient_bytes == 150 + 300


def test_stage_cost_rejects_bad_bounds():
    arrays = block_arrays(_profile(), TrainingSetup(pp_size=1, num_microbatches=1))
    with pytest.raises(ValueError, match="bad stage bounds"):
        stage_cost(arrays, 2, 1)


def test_comm_ms():
    setup = TrainingSetup(pp_size=2, num_microbatches=1, link_bandwidth_bytes_per_s=1e9,
                          link_latency_ms=0.5)
    assert comm_ms(0, setup) == 0.0
    assert comm_ms(10**6, setup) == pytest.approx(1.5)


@pytest.mark.parametrize(("pp", "v", "style"), [(2, 2, "loop"), (4, 2, "v"), (3, 3, "loop"),
                                                (4, 4, "v")])
def test_stage_to_rank_matches_torch(pp, v, style):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    expected = generate_stage_to_rank_mapping(pp, pp * v, style=style)
    assert {s: stage_to_rank(s, pp, v, style) for s in range(pp * v)} == expected
    assert sorted(s for r in range(pp) for s in stages_of_rank(r, pp, v, style)) == \
        list(range(pp * v))


def test_schedule_constraints():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "looped-bfs",
                              "interleaved-zb", "zbv", "dualpipev"}
    check_schedule("1f1b", 4, 1, 4)
    check_schedule("zbv", 2, 2, 4)
    with pytest.raises(PlanError, match="at least as many microbatches"):
        check_schedule("1f1b", 4, 1, 3)
    with pytest.raises(PlanError, match="exactly 2"):
        check_schedule("zbv", 2, 3, 8)
    with pytest.raises(PlanError, match="unknown schedule 'fast'"):
        check_schedule("fast", 2, 1, 4)
    with pytest.raises(PlanError, match="multiple of"):
        check_schedule("interleaved-1f1b", 4, 2, 10 + 1)


def test_training_setup_validates():
    with pytest.raises(SchemaError, match="pp_size"):
        TrainingSetup(pp_size=0, num_microbatches=1)
    with pytest.raises(SchemaError, match="optimizer"):
        TrainingSetup(pp_size=1, num_microbatches=1, optimizer="lion")


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["blocks"][1].__setitem__("fwd_ms", "abc"), "should be a number"),
    (lambda d: d["blocks"][1].__setitem__("fwd_ms", float("nan")), "finite number >= 0"),
    (lambda d: d["blocks"][1].__setitem__("activation_bytes", -1), "finite number >= 0"),
    (lambda d: d["blocks"][1].__setitem__("kind", "banana"), "kind 'banana'"),
    (lambda d: d["blocks"][2].__setitem__("name", "b"), "must be unique"),
    (lambda d: d["setup"].__setitem__("micro_batch_size", 0), "must be >= 1"),
])
def test_profile_values_are_checked(mutate, message):
    data = json.loads(_profile().to_json())
    mutate(data)
    with pytest.raises(SchemaError, match=message):
        Profile.from_json(json.dumps(data), "p.json")


def test_output_folders_are_created_and_unwritable_outputs_are_one_error(tmp_path):
    from autopart.errors import AutopartError

    _profile().save(tmp_path / "new" / "folder" / "p.json")
    assert Profile.load(tmp_path / "new" / "folder" / "p.json") == _profile()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(AutopartError, match="cannot write .*cannot create its folder"):
        _profile().save(tmp_path / "a_file" / "p.json")


def test_negative_link_latency_is_rejected():
    with pytest.raises(SchemaError, match="latency must be >= 0"):
        TrainingSetup(pp_size=1, num_microbatches=1, link_latency_ms=-1.0)


def test_plan_refuses_another_models_fingerprint():
    from autopart.errors import RuntimeSetupError

    plan = _two_stage_plan()
    plan.check_model("f", "tiny")
    with pytest.raises(RuntimeSetupError, match=r"made for another model \(profile fingerprint "
                                                r"f, 'tiny' has g\); profile and plan 'tiny'"):
        plan.check_model("g", "'tiny'")

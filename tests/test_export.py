"""Exports: plans rendered for NxD, NeMo/torchtitan and Megatron, checked by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from autopart.errors import PlanError
from autopart.export import export_plan, to_megatron_layout, to_module_fqns, to_nxd
from autopart.schema import (
    BlockProfile,
    ModelInfo,
    Plan,
    Profile,
    ProfileSetup,
    RankPlan,
    StagePlan,
    TrainingSetup,
)
from autopart.solve import make_plan
from autopart.targets import planning_constraints

NAMES = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(6)] + ["model.norm", "lm_head"]
KINDS = ["embedding"] + ["decoder_layer"] * 6 + ["norm", "head"]
CLASSES = ["Embedding"] + ["LlamaDecoderLayer"] * 6 + ["LlamaRMSNorm", "Linear"]


def _profile() -> Profile:
    blocks = tuple(BlockProfile(name=n, kind=k, class_name=c, fwd_ms=1.0, bwd_ms=2.0,
                                bwd_input_ms=1.0, bwd_weight_ms=1.0, param_bytes=4,
                                activation_bytes=1, output_bytes=1, transient_bytes=1)
                   for n, k, c in zip(NAMES, KINDS, CLASSES, strict=True))
    return Profile(model=ModelInfo(name="tiny", fingerprint="f", num_params=9,
                                   family="llama", layer_classes=("LlamaDecoderLayer",),
                                   shared_modules=("model.rotary_emb",)),
                   setup=ProfileSetup(backend="cpu", device_name="cpu", dtype="float32",
                                      micro_batch_size=2, seq_len=8, torch_version="x"),
                   blocks=blocks)


def _plan(sizes: list[int], schedule: str = "1f1b", v: int = 1, m: int = 4) -> Plan:
    pp = len(sizes) // v
    stages, start = [], 0
    for i, size in enumerate(sizes):
        stages.append(StagePlan(index=i, rank=i % pp, modules=tuple(NAMES[start:start + size]),
                                fwd_ms=1.0, bwd_ms=2.0, param_count=1))
        start += size
    assert start == len(NAMES)
    cuts = tuple(s.modules[-1] for s in stages[:-1])
    ranks = tuple(RankPlan(rank=r, stages=tuple(s.index for s in stages if s.rank == r),
                           peak_memory_bytes=1, busy_ms=1.0) for r in range(pp))
    return Plan(profile_fingerprint="f", pp_size=pp, virtual_stages=v, schedule=schedule,
                num_microbatches=m, pipeline_cuts=cuts, stages=tuple(stages), ranks=ranks,
                predicted_step_ms=10.0, bubble_fraction=0.1, model_name="tiny",
                setup=TrainingSetup(pp_size=pp, num_microbatches=m))


def test_nxd_cuts_and_classes():
    args = to_nxd(_plan([4, 5]), _profile())
    assert args["pipeline_cuts"] == ["model.layers.2"]
    assert args["transformer_layer_cls"] == ["LlamaDecoderLayer"]
    assert args["leaf_module_cls"] == ["LlamaRMSNorm"]
    snippet = export_plan(_plan([4, 5]), _profile(), "nxd")
    assert 'pipeline_cuts = ["model.layers.2"]' in snippet
    assert "virtual_pipeline_size=1" in snippet


def test_nxd_refuses_cut_outside_layers_and_bad_microbatches():
    with pytest.raises(PlanError, match="'model.embed_tokens' .kind embedding. is not where NxD "
                                        "can cut: only after decoder_layer blocks"):
        to_nxd(_plan([1, 8]), _profile())
    with pytest.raises(PlanError, match="divisible by pp"):
        to_nxd(_plan([2, 2, 2, 3], schedule="interleaved-1f1b", v=2, m=5), _profile())


def test_module_fqns_and_nemo_rotary():
    plan = _plan([4, 5])
    assert to_module_fqns(plan)[1] == NAMES[4:]
    nemo = json.loads(export_plan(plan, _profile(), "nemo"))
    assert all(part[-1] == "model.rotary_emb" for part in nemo["module_fqns_per_model_part"])
    titan = json.loads(export_plan(plan, _profile(), "torchtitan", module_names="hf"))
    assert titan["parallelism"]["module_fqns_per_model_part"][0] == NAMES[:4]


class _TitanBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention, self.feed_forward = nn.Linear(dim, dim), nn.Linear(dim, dim)


class _TitanTransformer(nn.Module):
    """The module tree of torchtitan's Llama ``Transformer``: layers in a ModuleDict."""

    def __init__(self, vocab: int, dim: int, num_layers: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(dim) for i in range(num_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


@pytest.mark.parametrize("sizes", [[4, 5], [1, 3, 3, 2], [2, 2, 2, 3]])
def test_torchtitan_names_exist_in_a_torchtitan_model(sizes):
    """Every FQN of the export resolves in a torchtitan-style model built on meta, and the
    parts cover its top-level modules and layers once each, in order."""
    with torch.device("meta"):
        titan_model = _TitanTransformer(vocab=32, dim=8, num_layers=6)
    plan = _plan(sizes)
    parts = json.loads(export_plan(plan, _profile(), "torchtitan"))["parallelism"][
        "module_fqns_per_model_part"]
    for fqn in (f for part in parts for f in part):
        titan_model.get_submodule(fqn)
    flat = [f for part in parts for f in part]
    assert flat == ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm", "output"]
    assert [len(part) for part in parts] == sizes


def test_torchtitan_export_of_a_real_profile_names_modules_that_exist():
    """tiny-llama, profiled on meta and planned for torchtitan: native names resolve in a
    torchtitan-style model, HF names in the HF model (both built on meta)."""
    from autopart.intake import load_model
    from autopart.profile import profile_model

    profile = profile_model("tiny-llama", backend="analytical:h100", seq_len=16)
    plan = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b",
                     target="torchtitan")
    with torch.device("meta"):
        titan_model = _TitanTransformer(vocab=512, dim=64, num_layers=4)
    hf_model = load_model("tiny-llama").model
    for names, model in (("native", titan_model), ("hf", hf_model)):
        text = export_plan(plan, profile, "torchtitan", module_names=names)
        parts = json.loads(text)["parallelism"]["module_fqns_per_model_part"]
        assert len(parts) == 2
        for fqn in (f for part in parts for f in part):
            model.get_submodule(fqn)


def test_torchtitan_names_need_an_hf_layout():
    blocks = tuple(dataclasses.replace(b, kind="block") for b in _profile().blocks)
    generic = dataclasses.replace(_profile(), blocks=blocks)
    with pytest.raises(PlanError, match="has no torchtitan module.*--module-names hf"):
        export_plan(_plan([4, 5]), generic, "torchtitan")
    parts = json.loads(export_plan(_plan([4, 5]), generic, "torchtitan", module_names="hf"))
    assert parts["parallelism"]["module_fqns_per_model_part"][1] == NAMES[4:]


def test_megatron_layout():
    assert to_megatron_layout(_plan([4, 5]), _profile()) == "Et*3|t*3L"
    assert to_megatron_layout(_plan([2, 2, 2, 3], "interleaved-1f1b", v=2), _profile()) == \
        "Et|tt|tt|tL"
    with pytest.raises(PlanError, match="Megatron runs no zbv schedule"):
        to_megatron_layout(_plan([2, 2, 2, 3], "zbv", v=2), _profile())
    with pytest.raises(PlanError, match="runs no looped-bfs schedule"):
        to_megatron_layout(_plan([2, 2, 2, 3], "looped-bfs", v=2), _profile())


def test_nxd_refuses_schedules_it_lacks():
    with pytest.raises(PlanError, match="NxD runs no gpipe schedule"):
        to_nxd(_plan([4, 5], schedule="gpipe"), _profile())


def test_torchtitan_takes_the_plans_microbatch_size_and_schedule():
    plan = dataclasses.replace(_plan([4, 5]), micro_batch_size=4)
    titan = json.loads(export_plan(plan, _profile(), "torchtitan"))["parallelism"]
    assert titan["pipeline_parallel_microbatch_size"] == 4
    assert titan["pipeline_parallel_schedule"] == "1F1B"


def test_megatron_keeps_the_norm_with_the_head():
    """The layout has no symbol for the final norm: a cut between norm and head is refused."""
    with pytest.raises(PlanError, match="'model.norm' .kind norm. is not where Megatron can cut"):
        to_megatron_layout(_plan([8, 1]), _profile())


def test_planning_constraints_are_the_export_rules():
    nxd = planning_constraints("nxd")
    assert nxd.cut_kinds == ("decoder_layer",)
    assert nxd.schedules_for("auto", pp_size=2, num_microbatches=4) == ["1f1b",
                                                                       "interleaved-1f1b"]
    assert nxd.schedules_for("auto", pp_size=4, num_microbatches=6) == ["1f1b"]
    assert nxd.schedules_for("1f1b", pp_size=4, num_microbatches=6) == "1f1b"
    with pytest.raises(PlanError, match="NxD runs no zbv schedule"):
        nxd.schedules_for(["1f1b", "zbv"], pp_size=2, num_microbatches=4)
    with pytest.raises(PlanError, match=r"divisible by pp \(4\)"):
        nxd.schedules_for("interleaved-1f1b", pp_size=4, num_microbatches=6)
    titan = planning_constraints("torchtitan")
    assert (titan.cut_kinds, titan.schedules_for("zbv", pp_size=2, num_microbatches=2)) == \
        (None, "zbv")


def test_make_plan_for_a_target_exports_without_further_rules():
    """A library user plans for NxD and Megatron with make_plan alone (no CLI)."""
    profile = dataclasses.replace(_profile(), blocks=tuple(
        dataclasses.replace(b, fwd_ms=20.0 if b.kind == "head" else 1.0)
        for b in _profile().blocks))
    for target in ("nxd", "megatron"):
        plan = make_plan(profile, pp_size=2, num_microbatches=4, target=target)
        assert plan.schedule in ("1f1b", "interleaved-1f1b")
        assert export_plan(plan, profile, target)
    plan = make_plan(profile, pp_size=2, num_microbatches=4, target="nxd")
    kinds = {b.name: b.kind for b in profile.blocks}
    assert all(kinds[cut] == "decoder_layer" for cut in plan.pipeline_cuts)
    with pytest.raises(PlanError, match="NxD runs no gpipe schedule"):
        make_plan(profile, pp_size=2, num_microbatches=4, schedule="gpipe", target="nxd")


def test_unknown_format():
    with pytest.raises(PlanError, match="unknown export format"):
        export_plan(_plan([4, 5]), _profile(), "deepspeed")


def test_exports_carry_the_mesh():
    """A tp 2 x pp 2 x dp 2 plan: each tool gets its own TP / PP flags, checked by hand."""
    plan = dataclasses.replace(_plan([4, 5]), tp_size=2, dp_size=2)
    args = to_nxd(plan, _profile())
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (2, 2)
    snippet = export_plan(plan, _profile(), "nxd")
    assert "tensor_model_parallel_size=2," in snippet
    assert "pipeline_model_parallel_size=2," in snippet
    assert export_plan(plan, _profile(), "megatron").startswith(
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 ")
    titan = json.loads(export_plan(plan, _profile(), "torchtitan"))["parallelism"]
    assert (titan["tensor_parallel_degree"], titan["pipeline_parallel_degree"],
            titan["data_parallel_replicate_degree"]) == (2, 2, 2)
    zero = dataclasses.replace(plan, zero_stage=1)
    assert "--use-distributed-optimizer" in export_plan(zero, _profile(), "megatron")
    with pytest.raises(PlanError, match="torchtitan has no ZeRO-1"):
        export_plan(zero, _profile(), "torchtitan")
    no_sp = dataclasses.replace(plan, sequence_parallel=False)
    assert "--sequence-parallel" not in export_plan(no_sp, _profile(), "megatron")


def test_fsdp_plans_export_to_torchtitan_and_are_refused_elsewhere():
    """FSDP (zero_stage 3) is torchtitan's data_parallel_shard_degree, with its reshard
    policy; Megatron and NxD run no FSDP under pipeline parallelism: one line each."""
    plan = dataclasses.replace(_plan([4, 5]), dp_size=2, zero_stage=3,
                               reshard_after_forward=True)
    titan = json.loads(export_plan(plan, _profile(), "torchtitan"))["parallelism"]
    assert (titan["data_parallel_shard_degree"], titan["data_parallel_replicate_degree"],
            titan["fsdp_reshard_after_forward"]) == (2, 1, "always")
    for fmt, tool in (("megatron", "Megatron"), ("nxd", "NxD")):
        with pytest.raises(PlanError, match=f"{tool} has no FSDP under pipeline parallelism"):
            export_plan(plan, _profile(), fmt)


def test_exports_without_a_mesh_are_unchanged():
    plan = _plan([4, 5])
    assert "initialize_model_parallel" not in export_plan(plan, _profile(), "nxd")
    assert export_plan(plan, _profile(), "megatron").startswith("--pipeline-model-parallel")
    assert "tensor_parallel_degree" not in export_plan(plan, _profile(), "torchtitan")

"""Sub-layer blocks: decoder layers split into attention and MLP halves where exact.

Expected halves are written out by hand from each family's layer code; families
whose layer runs attention and MLP off one residual (NeoX, Falcon) stay whole.
"""

from __future__ import annotations

import pytest
import torch
from families import tiny_config
from torch import nn

from autopart.errors import ModelSourceError
from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.levels import coarsen, coarsen_blocks
from autopart.profile import profile_model
from autopart.solve.baselines import baseline_split


def _sub(model_type: str):
    return discover_blocks(build_hf_model(tiny_config(model_type)), granularity="half")


def test_llama_layers_split_into_attention_and_mlp_halves():
    chain = _sub("llama")
    assert chain.granularity == "half" and not chain.notes
    assert chain.names[:5] == ["model.embed_tokens", "model.layers.0.self_attn",
                               "model.layers.0.mlp", "model.layers.1.self_attn",
                               "model.layers.1.mlp"]
    first, second = chain.blocks[1], chain.blocks[2]
    assert (first.kind, first.layer, first.modules) == (
        "attention", "model.layers.0",
        ("model.layers.0.input_layernorm", "model.layers.0.self_attn"))
    assert (second.kind, second.modules) == (
        "mlp", ("model.layers.0.post_attention_layernorm", "model.layers.0.mlp"))
    assert chain.names[-2:] == ["model.norm", "lm_head"]


def test_fingerprint_does_not_depend_on_granularity():
    model = build_hf_model(tiny_config("qwen2"))
    assert discover_blocks(model).fingerprint == \
        discover_blocks(model, granularity="half").fingerprint


def test_gemma3_half_ends_after_the_post_attention_norm():
    """Gemma 3 normalizes the attention output before the residual add: the cut is after it."""
    chain = _sub("gemma3_text")
    assert chain.names[1:3] == ["model.layers.0.post_attention_layernorm",
                                "model.layers.0.post_feedforward_layernorm"]
    assert chain.blocks[2].modules[0] == "model.layers.0.pre_feedforward_layernorm"


@pytest.mark.parametrize("model_type", ["gpt_neox", "falcon"])
def test_parallel_attention_and_mlp_stay_whole(model_type):
    whole = discover_blocks(build_hf_model(tiny_config(model_type)))
    chain = _sub(model_type)
    assert chain.granularity == "layer" and chain.names == whole.names
    assert len(chain.notes) == 1 and "stay whole" in chain.notes[0]
    assert "in parallel" in chain.notes[0]


class _Scaled(nn.Module):
    """A residual layer that holds a parameter of its own (a layer scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.fc(self.norm(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Scaled() for _ in range(3)])
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_layer_with_its_own_parameter_stays_whole():
    chain = discover_blocks(_Net().to("meta"), granularity="half")
    assert chain.granularity == "layer"
    assert chain.names == ["layers.0", "layers.1", "layers.2", "out"]
    assert "'gamma'" in chain.notes[0]


def test_unknown_granularity_is_one_line():
    with pytest.raises(ModelSourceError, match="granularity 'slice' is not one of"):
        discover_blocks(_Net().to("meta"), granularity="slice")


@pytest.fixture(scope="module")
def profiles():
    model = build_hf_model(tiny_config("llama"))
    kw = {"backend": "analytical:h100", "seq_len": 32, "dtype": "bfloat16"}
    return (profile_model(model, granularity="layer", **kw),
            profile_model(model, granularity="half", **kw))


def test_sublayer_profile_measures_identical_halves_once(profiles):
    _, sub = profiles
    assert sub.setup.granularity == "half" and sub.model.num_layers == 4
    halves = [b for b in sub.blocks if b.layer]
    assert [b.kind for b in halves[:2]] == ["attention", "mlp"]
    assert [b.reused_from for b in halves[2:4]] == ["model.layers.0.self_attn",
                                                    "model.layers.0.mlp"]
    assert sub.model.fingerprint == profiles[0].model.fingerprint
    assert any(n.startswith("half:") for n in sub.model.notes)


def test_fused_half_profile_matches_the_layer_profile(profiles):
    whole, sub = profiles
    fused = coarsen(sub, "layer")
    assert fused.setup.granularity == "layer"
    assert [b.name for b in fused.blocks] == [b.name for b in whole.blocks]
    assert [b.kind for b in fused.blocks] == [b.kind for b in whole.blocks]
    for a, b in zip(fused.blocks, whole.blocks):
        assert a.num_params == b.num_params and a.param_bytes == b.param_bytes
        # the residual adds between halves are glue at sublayer granularity
        assert a.fwd_ms <= b.fwd_ms + 1e-9 and a.fwd_ms > 0.7 * b.fwd_ms
    assert fused.blocks[2].reused_from == "model.layers.0"
    assert coarsen(whole, "layer").blocks == whole.blocks


def test_baselines_never_cut_inside_a_layer(profiles):
    """The public rules cut a half profile where they cut the layer profile."""
    whole, sub = profiles
    fused, positions = coarsen_blocks(sub.blocks, "layer")
    assert positions[1:3] == [1, 3] and len(fused) == len(whole.blocks)
    starts = {p: k for k, p in enumerate(positions[:-1])}
    for name in ("even", "params", "torchtitan"):
        got = baseline_split(name, sub.blocks, 3)
        assert all(i in starts for i, _ in got), (name, got)
        units = [starts[i] for i, _ in got]
        assert units == [i for i, _ in baseline_split(name, whole.blocks, 3)], name


def test_exports_plan_a_sublayer_profile_at_layer_granularity(profiles):
    """NxD and Megatron name whole layers: the halves are fused, and the plan says so."""
    from autopart.export import export_plan
    from autopart.solve import make_plan

    whole, sub = profiles
    plan = make_plan(sub, pp_size=2, num_microbatches=4, schedule="1f1b", target="nxd")
    layer_names = {b.name for b in whole.blocks}
    assert all(m in layer_names for s in plan.stages for m in s.modules)
    assert any("planned at layer granularity" in n for n in plan.notes)
    assert "pipeline_cuts" in export_plan(plan, sub, "nxd")
    finer = make_plan(sub, pp_size=2, num_microbatches=4, schedule="1f1b", split_head=False)
    planned = [m for s in finer.stages for m in s.modules]
    assert planned == [b.name for b in sub.blocks] and finer.granularity == "half"


def test_runtime_builds_the_chain_at_the_plans_granularity(profiles):
    from autopart.runtime.builder import chain_for_plan
    from autopart.solve import make_plan

    model = build_hf_model(tiny_config("llama"))
    chain = discover_blocks(model)
    for profile in profiles:
        plan = make_plan(profile, pp_size=2, num_microbatches=4, schedule="1f1b",
                         split_head=False)
        picked = chain_for_plan(model, chain, plan)
        assert picked.names == [b.name for b in profile.blocks]
        assert picked.granularity == profile.setup.granularity

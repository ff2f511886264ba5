"""The families people train now, pipelined on 2 gloo ranks, against the unpipelined model.

gpt-oss (attention sinks, sliding / full layers), Llama 4 text (chunked attention,
rope-less layers, shared expert), Qwen3-Next and Qwen3.5 (hybrid gated delta-net
linear attention with a convolution, full attention every other layer), DeepSeek-V2
(multi-head latent attention, MoE with shared experts). Each family's tiny config is
discovered at its finest level (``projection``; halves stay whole where a cut inside
them is not exact, the chain's notes say why) and profiled on the CPU at every level;
one step of a padded batch under 1F1B and Interleaved 1F1B, with the first cut inside
layer 0 (and under 1F1B cut between two slices of a half where the family's halves slice),
must give the loss and every gradient of the same model run whole, max abs
diff < 1e-5 in fp32.
"""

from __future__ import annotations

import pytest
from families import CURRENT_FAMILIES, reference_run, tiny_config
from runtime_helpers import check_exact, exact_step, make_stage_plan, planned_blocks, run_ranks

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime.builder import tied_parameters

TOL = 1e-5


def _plans(num_blocks: int) -> dict[str, list[int]]:
    """1F1B cutting after the first block of layer 0 (inside it at half and projection
    level), Interleaved 1F1B with four stages."""
    return {"1f1b": [2, num_blocks - 2], "interleaved-1f1b": [2, 2, 3, num_blocks - 7]}


# halves cut into slices where their structure allows (``half_slices.slice_rule``): Llama 4's
# attention by KV-head groups, the dense MLPs of Qwen3.5 and DeepSeek-V2's first layer by
# columns (gpt-oss's attention reads its sinks, Qwen3-Next's MLPs are MoE and its gated
# attention's query projection is twice the heads: none slices)
SLICED = {"llama4_text": "model.layers.1.self_attn", "qwen3_5_text": "model.layers.0.mlp",
          "deepseek_v2": "model.layers.0.mlp"}


def _worker(rank: int, world_size: int, model_type: str, granularity: str) -> dict:
    config = tiny_config(model_type)
    reference = reference_run(config)
    chain = discover_blocks(build_hf_model(config), granularity=granularity)
    aliases = {b: a for a, b in tied_parameters(build_hf_model(config), chain)}
    results = {"ref_loss": reference.loss, "ref_keys": sorted(reference.state),
               "granularity": chain.granularity, "num_blocks": len(chain.blocks)}
    for schedule, counts in _plans(len(chain.blocks)).items():
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=4)
        results[schedule] = exact_step(config, plan, reference, aliases, False)
    if model_type in SLICED:  # 1F1B with the cut between the two slices of a half
        half = discover_blocks(build_hf_model(config), granularity="half")
        blocks = planned_blocks(half, units={SLICED[model_type]: 2})
        first = next(i for i, (name, _) in enumerate(blocks) if "slice" in name)
        plan = make_stage_plan(half, [first + 1, len(blocks) - first - 1], schedule="1f1b",
                               pp_size=world_size, num_microbatches=4, blocks=blocks)
        results["slice"] = exact_step(config, plan, reference, aliases, False)
    return results


# blocks at layer, half, projection level; the notes say why halves stay whole
LEVEL_SIZES = {"deepseek_v2": (7, 11, 16), "gpt_oss": (7, 11, 11),
               "llama4_text": (7, 11, 15), "qwen3_5_text": (7, 11, 17),
               "qwen3_next": (7, 11, 13)}


@pytest.mark.parametrize("model_type", sorted(CURRENT_FAMILIES))
def test_current_family_discovers_every_level(model_type):
    """Layer, half and projection chains (attention sinks and a linear attention's own
    parameters keep their half whole, with a note, rather than failing the watch)."""
    sizes = tuple(len(discover_blocks(build_hf_model(tiny_config(model_type)),
                                      granularity=level).blocks)
                  for level in ("layer", "half", "projection"))
    assert sizes == LEVEL_SIZES[model_type]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", ["llama4_text"])
def test_current_family_profiles_on_cpu(model_type):
    """A CPU profile at the finest level measures every block (Llama 4 moves its input ids
    to its embedding's device: the profiler keeps them real)."""
    from autopart.profile import profile_model

    profile = profile_model(build_hf_model(tiny_config(model_type)), backend="cpu",
                            seq_len=8, num_warmup=0, num_repeats=1)
    assert profile.setup.granularity == "projection"
    assert all(b.fwd_ms > 0 for b in profile.blocks)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", sorted(CURRENT_FAMILIES))
def test_current_family_trains_exactly_with_cuts_inside_layers(tmp_path, model_type):
    """1F1B and Interleaved 1F1B on the finest chain, loss and gradients within 1e-5."""
    results = run_ranks(_worker, 2, tmp_path, model_type, "projection")
    plans = ("1f1b", "interleaved-1f1b", *(("slice",) if model_type in SLICED else ()))
    check_exact(results, dict.fromkeys(plans), TOL)

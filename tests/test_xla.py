"""The ``xla`` backend on a real torch_xla device, then the NxD hand-off of its plan.

Skipped where torch_xla is not installed (the default dev venv). Run it in the
environment ``scripts/xla_env.sh`` builds, with ``PJRT_DEVICE=CPU`` (XLA:CPU) here or
``PJRT_DEVICE=NEURON`` on trn1/trn2. Times are compared with nothing but
themselves (positive, no compilation inside a timed round); memory computed on
meta is compared with the analytical backend's, which computes it the same way;
the plan's cuts are compared with NxD's even split (``model.layers.3`` for 8 layers
on pp 2).
"""

from __future__ import annotations

import pytest

torch_xla = pytest.importorskip("torch_xla")

import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from autopart.errors import PlanError
from autopart.export import nxd_snippet, to_nxd
from autopart.profile import measure, profile_model
from autopart.solve import make_plan

_TIMES = ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms")
_NXD_EVEN_CUT = "model.layers.3"
"""NxD's even split of 8 layers on pp 2: 4 layers a stage, cut after the 4th."""

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama on XLA, with the XLA compilations of every round counted."""
    rounds: list[int] = []
    original = measure._timed_round

    def counted(task, backend, grad_out):
        before = _compiles()
        result = original(task, backend, grad_out)
        rounds.append(_compiles() - before)
        return result

    measure._timed_round = counted
    try:
        profile = profile_model("tiny-llama", backend="xla", seq_len=16, num_warmup=1,
                                num_repeats=3)
    finally:
        measure._timed_round = original
    return profile, rounds


@pytest.fixture(scope="module")
def heavy_head():
    return profile_model("heavy-head-llama", backend="xla", seq_len=32, num_warmup=1,
                         num_repeats=3)


def _device_reports_memory() -> bool:
    try:
        xm.get_memory_info(torch_xla.device())
    except RuntimeError:
        return False
    return True


def test_profile_runs_on_the_xla_device_with_positive_times(tiny):
    profile, _ = tiny
    assert profile.setup.backend == "xla"
    assert profile.setup.device_name.startswith("XLA") and "xla:0" in profile.setup.device_name
    assert profile.setup.time_source.startswith("measured: mark_step + wait_device_ops")
    for block in profile.blocks:
        assert block.fwd_ms > 0 and block.bwd_ms > 0, block.name
        assert block.bwd_input_ms >= 0 and block.bwd_weight_ms >= 0, block.name
    embedding = profile.blocks[0]
    assert embedding.kind == "embedding" and embedding.bwd_input_ms == 0  # token ids: no B


def test_every_block_compiles_in_warmup_and_never_in_a_timed_round(tiny):
    profile, rounds = tiny
    measured_blocks = [b for b in profile.blocks if not b.reused_from]
    per_block = 1 + 3  # num_warmup + num_repeats rounds each
    assert len(rounds) == per_block * len(measured_blocks)
    for i, block in enumerate(measured_blocks):
        warmup, *timed = rounds[i * per_block:(i + 1) * per_block]
        assert warmup > 0, f"{block.name}: nothing compiled in warm-up"
        assert timed == [0, 0, 0], f"{block.name}: compiled inside timed rounds: {timed}"
        assert block.compile_ms > 0, block.name


def test_memory_source_and_measured_fields_are_honest(tiny):
    profile, _ = tiny
    reports = _device_reports_memory()
    assert profile.setup.memory_source.startswith("measured" if reports else "computed")
    expected = {*_TIMES, "param_bytes"} | ({"activation_bytes"} if reports else set())
    for block in profile.blocks:
        assert set(block.measured) == expected, block.name


@pytest.mark.skipif(_device_reports_memory(), reason="this device measures activations")
def test_computed_memory_matches_the_meta_computation(tiny):
    """Saved activations, outputs and parameters equal the analytical backend's.

    The transient figure is only checked to be positive: the live-tensor peak on meta
    differs from process to process (see docs/neuroncore.md, "Known limits").
    """
    profile, _ = tiny
    meta = profile_model("tiny-llama", backend="analytical:trn2", seq_len=16)
    for x, m in zip(profile.blocks, meta.blocks, strict=True):
        assert x.name == m.name
        assert (x.activation_bytes, x.output_bytes, x.param_bytes) == (
            m.activation_bytes, m.output_bytes, m.param_bytes), x.name
        assert x.transient_bytes > 0, x.name


def test_even_split_exports_to_nxd_at_layer_names(heavy_head):
    """partition="even" is NxD's own split: its export must be exactly NxD's cut."""
    plan = make_plan(heavy_head, pp_size=2, schedule="1f1b", num_microbatches=4,
                     partition="even")
    args = to_nxd(plan, heavy_head)
    assert args["pipeline_cuts"] == [_NXD_EVEN_CUT]
    assert args["transformer_layer_cls"] == ["LlamaDecoderLayer"]
    assert args["leaf_module_cls"] == ["LlamaRMSNorm"]
    snippet = nxd_snippet(plan, heavy_head)
    assert f'pipeline_cuts = ["{_NXD_EVEN_CUT}"]' in snippet
    assert "transformer_layer_cls=LlamaDecoderLayer," in snippet


def test_layer_bound_plan_moves_the_cut_off_nxds_even_split(heavy_head):
    """With cuts restricted to decoder layers (what ``--format nxd`` asks for), the head
    (vocab 32768 x hidden 256, heavier than the 8 layers) pulls the cut past NxD's even
    ``model.layers.3``, the step beats the even split, and to_nxd takes the plan as is."""
    plan = make_plan(heavy_head, pp_size=2, schedule="1f1b", num_microbatches=4,
                     cut_kinds=("decoder_layer",))
    kinds = {b.name: b.kind for b in heavy_head.blocks}
    assert [kinds[cut] for cut in plan.pipeline_cuts] == ["decoder_layer"]
    assert list(plan.pipeline_cuts) != [_NXD_EVEN_CUT]
    assert plan.predicted_step_ms < plan.baselines["even"].predicted_step_ms
    assert to_nxd(plan, heavy_head)["pipeline_cuts"] == list(plan.pipeline_cuts)


def test_unrestricted_plan_off_a_layer_is_refused_by_to_nxd(heavy_head):
    """Left free, the planner may give the head a stage of its own (a cut after
    ``model.norm``), which NxD cannot express: to_nxd must say so, not export it."""
    plan = make_plan(heavy_head, pp_size=2, schedule="1f1b", num_microbatches=4)
    kinds = {b.name: b.kind for b in heavy_head.blocks}
    if all(kinds[cut] == "decoder_layer" for cut in plan.pipeline_cuts):
        assert to_nxd(plan, heavy_head)["pipeline_cuts"] == list(plan.pipeline_cuts)
    else:
        with pytest.raises(PlanError, match="not at a transformer layer"):
            to_nxd(plan, heavy_head)

"""Mesh planning: TP sharding and collective times against hand-worked figures, mesh
enumeration, ZeRO-1 memory, the DP gradient sync, and one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from solve_helpers import llama_like, make_block, make_profile

from autopart.cost.blocks import block_arrays, static_bytes_per_param
from autopart.cost.mesh import (
    TP_COLLECTIVES,
    TP_EFFICIENCY,
    gather_per_microbatch,
    ring_all_gather_ms,
    ring_all_reduce_ms,
    shard_profile,
    tp_collectives,
)
from autopart.errors import PlanError
from autopart.profile import load_device_spec
from autopart.profile.devices import LinkSpec
from autopart.profile.tp_shard import shard_config
from autopart.schedules import SCHEDULES
from autopart.schema import BLOCK_KINDS, Plan, TrainingSetup
from autopart.solve.mesh import plan_mesh
from autopart.solve.mesh_shapes import mesh_sizes
from cli.main import main


def _two_layers(activation_bytes: int = 340 * 10**6):
    """Two decoder layers of a 1 MB hidden state each keeping ``activation_bytes``."""
    return make_profile([make_block(f"layers.{i}", kind="decoder_layer", fwd_ms=1.0,
                                    num_params=1000, activation_bytes=activation_bytes,
                                    output_bytes=1_000_000) for i in range(2)])


def test_every_block_kind_has_its_tp_collectives():
    assert set(TP_COLLECTIVES) == set(BLOCK_KINDS)
    # the vocabulary-parallel embedding sums its lookups, the head its input gradient;
    # under sequence parallelism half each way
    assert tp_collectives("embedding", False) == (1, 0)
    assert tp_collectives("head", False) == (0, 1)
    assert tp_collectives("head", True) == tp_collectives("embedding", True) == (0.5, 0.5)
    assert tp_collectives("decoder_layer", True) == tp_collectives("decoder_layer", False)


def test_ring_collectives_by_hand():
    # 4 ranks, 4 GB, 1 GB/s: 2 * 3/4 * 4 s = 6 s, plus 6 steps of 0.1 ms.
    assert ring_all_reduce_ms(4e9, 4, 1e9, 0.1) == pytest.approx(6000 + 0.6)
    assert ring_all_gather_ms(4e9, 4, 1e9, 0.1) == pytest.approx(3000 + 0.3)
    assert ring_all_reduce_ms(4e9, 1, 1e9, 0.1) == 0.0


def test_tp2_halves_static_and_adds_two_all_reduces_each_way():
    """2 layers, tp 2, 1 GB/s, 0.01 ms: one all-reduce of 1 MB = 2 * 0.01 + 1e3 * 1e6 / 1e9
    = 1.02 ms; a layer does two in F and two in B. Sequence parallelism: one sequence
    shard (500 kB) crosses a cut; the layer keeps its two halves' gathered inputs (2 MB)
    whole and the rest of its 340 MB split: 2 + 338 / 2 = 171 MB."""
    sharded = shard_profile(_two_layers(), 2, bandwidth_bytes_per_s=1e9, latency_ms=0.01)
    block = sharded.blocks[1]
    assert block.fwd_ms == pytest.approx(1.0 / (2 * TP_EFFICIENCY) + 2 * 1.02)
    assert block.bwd_input_ms == pytest.approx(1.0 / (2 * TP_EFFICIENCY) + 2 * 1.02)
    assert block.bwd_weight_ms == pytest.approx(1.0 / (2 * TP_EFFICIENCY))
    assert block.num_params == 500 and block.activation_bytes == 171 * 10**6
    assert block.output_bytes == 500_000
    setup = TrainingSetup(pp_size=1, num_microbatches=1, optimizer="sgd")
    assert list(block_arrays(sharded, setup).static_bytes) == [6000, 6000]
    assert list(block_arrays(_two_layers(), setup).static_bytes) == [12000, 12000]
    assert sharded.model.fingerprint == _two_layers().model.fingerprint


def test_tp_without_sequence_parallel_keeps_ten_of_34_whole_and_sends_it_whole():
    sharded = shard_profile(_two_layers(340), 2, bandwidth_bytes_per_s=1e9, latency_ms=0.01,
                            sequence_parallel=False)
    assert sharded.blocks[0].activation_bytes == 340 * 10 // 34 + 340 * 24 // 34 // 2
    assert sharded.blocks[0].output_bytes == 1_000_000  # the replicated hidden state


def test_the_last_stage_holds_its_vocabulary_shard_of_the_logits():
    """A vocabulary-parallel head: the held logits are the shard's (1000 / 4 rows), and its
    input (1 MB) is kept whole among its 9 MB of activations: 1 + 8 / 4 = 3 MB."""
    profile = make_profile([
        make_block("layers.0", kind="decoder_layer", output_bytes=1_000_000),
        make_block("lm_head", kind="head", activation_bytes=9_000_000, output_bytes=4)])
    profile = dataclasses.replace(profile, model=dataclasses.replace(profile.model,
                                                                     vocab_size=1000))
    sharded = shard_profile(profile, 4, bandwidth_bytes_per_s=1e9, latency_ms=0.01)
    assert sharded.model.vocab_size == 250 and sharded.blocks[-1].activation_bytes == 3_000_000
    setup = TrainingSetup(pp_size=1, num_microbatches=1)
    held = block_arrays(sharded, setup).held_output_bytes[-1]
    assert held * 4 == block_arrays(profile, setup).held_output_bytes[-1]


def test_zero1_shards_optimizer_state_over_dp():
    # adam fp32: 4 params + 4 grads + 8 states; ZeRO-1 over 4 keeps 8 / 4 of the states.
    setup = TrainingSetup(pp_size=1, num_microbatches=1, dp_size=4, zero_stage=1)
    assert static_bytes_per_param(setup) == 4 + 4 + 8 / 4
    assert static_bytes_per_param(TrainingSetup(pp_size=1, num_microbatches=1, dp_size=4)) == 16


def test_mesh_sizes_keep_tp_within_a_node():
    meshes = mesh_sizes(16, 8, num_blocks=10)
    assert all(t * p * d == 16 and 8 % t == 0 and p <= 10 for t, p, d in meshes)
    assert {t for t, _, _ in meshes} == {1, 2, 4, 8}
    assert (16, 1, 1) not in meshes and (1, 16, 1) not in meshes
    assert mesh_sizes(16, 8, tp=4, num_blocks=10) == [(4, 1, 4), (4, 2, 2), (4, 4, 1)]
    assert [d for _, _, d in mesh_sizes(16, 8, tp=8, num_blocks=10, batch=(6, 1))] \
        == [2, 1]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tp": 3}, "--tp 3 does not divide --devices 16"),
    ({"tp": 16}, r"--tp 16 is larger than a node \(8 devices\)"),
    ({"dp": 4, "batch": (6, 1)},
     "--global-batch-size 6 is not divisible by --dp 4 x micro-batch size 1"),
    ({"pp": 16}, "no tp x pp x dp mesh of 16 devices"),
])
def test_bad_meshes_are_refused(kwargs, message):
    with pytest.raises(PlanError, match=message):
        mesh_sizes(16, 8, num_blocks=10, **kwargs)


def _spec():
    link = LinkSpec(bandwidth_bytes_per_s=1e9, latency_ms=0.01)
    return type(load_device_spec("h100"))(
        key="test", name="test", peak_flops={"float32": 1e12}, memory_bandwidth_bytes_per_s=1e12,
        memory_bytes=1 << 40, link_bandwidth_bytes_per_s=1e9, link_latency_ms=0.01,
        source="test", node_size=2, intra_node=link, inter_node=link)


def test_dp_sync_with_one_stage_is_the_whole_all_reduce():
    """pp 1: the only rank's last backward ends the pipeline, so the whole ring all-reduce
    of its float32 gradients (sgd) runs past the end."""
    profile = llama_like(2)
    result = plan_mesh(profile, devices=2, device=_spec(), tp_size=1, pp_size=1, dp_size=2,
                       num_microbatches=2,
                       optimizer="sgd", refine_evals=0, solver="dp")
    grads = 4 * profile.model.num_params
    assert result.plan.grad_sync_ms == pytest.approx(ring_all_reduce_ms(grads, 2, 1e9, 0.01))
    assert (result.plan.tp_size, result.plan.dp_size) == (1, 2)


def test_plan_mesh_ranks_meshes_and_says_why_they_lost():
    result = plan_mesh(llama_like(4), devices=4, device=_spec(), num_microbatches=4,
                       optimizer="sgd", refine_evals=0, solver="dp")
    steps = [c.step_ms for c in result.candidates if c.fits]
    assert steps == sorted(steps) and result.candidates[0].lost_because == ""
    assert all(c.lost_because.split()[0] in ("bubble", "communication", "compute")
               for c in result.candidates[1:])
    best = result.candidates[0]
    assert result.plan.predicted_step_ms + result.plan.grad_sync_ms == best.step_ms


def test_cli_mesh_errors_are_one_line(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(llama_like(4).to_json())
    for args, message in [
        (["--devices", "16", "--device", "h100", "--tp", "3"], "--tp 3 does not divide"),
        (["--devices", "16", "--device", "h100", "--tp", "16"], "larger than a node"),
        (["--devices", "16", "--device", "h100", "--dp", "4", "--global-batch-size", "6"],
         "not divisible by --dp 4"),
        (["--pp", "2", "--tp", "2"], "--tp, --dp, --dp-shard, --zero and --sequence-parallel"),
        (["--pp", "2", "--sequence-parallel", "off"], "--sequence-parallel need --devices"),
        (["--pp", "2", "--dp-shard", "params-per-step"], "need --devices"),
        (["--devices", "2", "--device", "h100", "--zero", "1", "--dp-shard",
          "params-per-step"], "--zero 1 means --dp-shard optimizer, not params-per-step"),
        ([], "give --pp N, or --devices N"),
        (["--devices", "16", "--device", "h100", "--tp", "2", "--pp", "4", "--virtual-stages",
          "2"], "tp 2 x pp 4 x dp 2: pp_size * virtual_stages (4 * 2) exceeds"),
    ]:
        assert main(["plan", str(path), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err


def test_shard_config_divides_heads_mlp_and_vocabulary():
    config = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
              "intermediate_size": 28672, "vocab_size": 128256, "eos_token_id": 128001}
    assert shard_config(config, 16) == {
        "hidden_size": 8192, "head_dim": 128, "num_attention_heads": 4,
        "num_key_value_heads": 1, "intermediate_size": 1792, "vocab_size": 8016}


def test_a_shard_profile_gives_params_and_without_sp_the_times():
    """The shard's own profile gives the parameters; its times and activations replace the
    scaled ones only without sequence parallelism (with it, every op is split by tp)."""
    whole = _two_layers()
    part = make_profile([make_block(f"layers.{i}", kind="decoder_layer", fwd_ms=0.7,
                                    num_params=400, activation_bytes=200,
                                    output_bytes=1_000_000) for i in range(2)])
    sp = shard_profile(whole, 2, bandwidth_bytes_per_s=1e9, latency_ms=0.01, shard=part)
    assert sp.blocks[0].fwd_ms == pytest.approx(1.0 / (2 * TP_EFFICIENCY) + 2 * 1.02)
    assert sp.blocks[0].num_params == 400
    assert sp.blocks[0].activation_bytes == 171 * 10**6  # sequence parallel: scaled
    no_sp = shard_profile(whole, 2, bandwidth_bytes_per_s=1e9, latency_ms=0.01, shard=part,
                          sequence_parallel=False)
    assert no_sp.blocks[0].fwd_ms == pytest.approx(0.7 + 2 * 1.02)
    assert no_sp.blocks[0].bwd_weight_ms == pytest.approx(0.7)
    assert no_sp.blocks[0].activation_bytes == 200


@pytest.mark.slow  # two analytical profiles: about 4 s on a loaded CPU
def test_analytical_shard_of_tiny_llama_has_the_same_blocks_and_fewer_params():
    """The analytical backend profiles the tp-divided config: same block chain, each
    decoder layer's and the head's parameters divided by tp (norms inside a layer whole)."""
    from autopart.profile import profile_model
    from autopart.profile.tp_shard import profile_tp_shard

    whole = profile_model("tiny-llama", backend="analytical:h100", seq_len=64)
    shard = profile_tp_shard(whole, 2)
    assert [b.name for b in shard.blocks] == [b.name for b in whole.blocks]
    head, shard_head = whole.blocks[-1], shard.blocks[-1]
    assert shard_head.num_params * 2 == head.num_params
    layer, shard_layer = whole.blocks[1], shard.blocks[1]
    assert layer.num_params / 2 < shard_layer.num_params < layer.num_params / 2 * 1.01
    assert shard_layer.fwd_ms < layer.fwd_ms
    measured = dataclasses.replace(whole, setup=dataclasses.replace(whole.setup, backend="cpu"))
    assert profile_tp_shard(measured, 2) is None


def test_zero1_sync_is_a_reduce_scatter_of_grads_and_an_all_gather_of_params():
    """pp 1, dp 2, ZeRO-1, bf16 params with fp32 grads: half an all-reduce of the 4-byte
    gradients plus half an all-reduce of the 2-byte parameters."""
    profile = llama_like(2)
    result = plan_mesh(profile, devices=2, device=_spec(), tp_size=1, pp_size=1, dp_size=2,
                       num_microbatches=2,
                       zero_stage=1, precision="bf16-mixed", refine_evals=0, solver="dp")
    n = profile.model.num_params
    want = ring_all_gather_ms(4 * n, 2, 1e9, 0.01) + ring_all_gather_ms(2 * n, 2, 1e9, 0.01)
    assert result.plan.grad_sync_ms == pytest.approx(want)
    assert result.plan.zero_stage == 1 and result.plan.setup.zero_stage == 1


def test_a_tp_plan_records_sequence_parallelism_and_no_runtime_caveat():
    """The planner prices TP as autopart's runtime runs it: the plan records whether the
    stream is sequence-parallel (the runtime does as it says) and carries no note that the
    runtime differs."""
    for sp in (True, False):
        tp2 = plan_mesh(llama_like(2), devices=2, device=_spec(), tp_size=2, pp_size=1,
                        dp_size=1,
                        num_microbatches=2, optimizer="sgd", refine_evals=0, solver="dp",
                        sequence_parallel=sp)
        assert tp2.plan.sequence_parallel is sp and tp2.plan.tp_size == 2
        assert not any("runtime" in note for note in tp2.plan.notes)
    old = json.loads(tp2.plan.to_json())
    del old["sequence_parallel"]  # a plan written before the key: planned with it on
    assert Plan.from_json(json.dumps(old)).sequence_parallel is True


def test_cli_sequence_parallel_off_plans_tp_without_it(tmp_path, capsys):
    """--sequence-parallel off reaches the cost model: the TP note says activations are
    kept as without sequence parallelism, where the default splits them all by tp."""
    path = tmp_path / "p.json"
    path.write_text(llama_like(4).to_json())
    notes = {}
    for flag in ("on", "off"):
        out = tmp_path / f"{flag}.json"
        assert main(["plan", str(path), "--devices", "2", "--device", "h100", "--tp", "2",
                     "--microbatches", "2", "--sequence-parallel", flag,
                     "--out", str(out)]) == 0
        notes[flag] = " ".join(Plan.from_json(out.read_text()).notes)
    capsys.readouterr()
    assert "as without sequence parallelism" in notes["off"]
    assert "activations / 2 but the split layers' gathered inputs" in notes["on"]


def test_fsdp_shards_stored_state_and_holds_the_gathered_stage_during_the_step():
    """FSDP over 4 (zero_stage 3): fp32 adam keeps (4 + 4 + 8) / 4 sharded and, during the
    step, the gathered parameters (4) and the whole gradients (4): 12 B; bf16-mixed: the
    fp32 master shards (4 + 4 + 8) / 4, bf16 gathered weights (2), fp32 gradients (4): 10."""
    plain = TrainingSetup(pp_size=1, num_microbatches=1, dp_size=4, zero_stage=3)
    assert static_bytes_per_param(plain) == 12
    mixed = TrainingSetup(pp_size=1, num_microbatches=1, dp_size=4, zero_stage=3,
                          param_dtype="bfloat16", master_weights=True)
    assert static_bytes_per_param(mixed) == 10
    per_mb = dataclasses.replace(plain, reshard_after_forward=True)
    assert static_bytes_per_param(per_mb) == 12


def test_fsdp_per_step_reduce_scatters_grads_and_gathers_the_first_stage():
    """pp 1, dp 2, FSDP once per step: the gradient reduce-scatter runs past the end and
    the only stage's all-gather before its first forward (at 0 ms) is not hidden."""
    profile = llama_like(2)
    result = plan_mesh(profile, devices=2, device=_spec(), tp_size=1, pp_size=1, dp_size=2,
                       num_microbatches=2,
                       zero_stage=3, optimizer="sgd", refine_evals=0, solver="dp")
    n = profile.model.num_params
    want = ring_all_gather_ms(4 * n, 2, 1e9, 0.01) * 2
    assert result.plan.grad_sync_ms == pytest.approx(want)
    assert (result.plan.zero_stage, result.plan.reshard_after_forward) == (3, False)


def test_gathering_per_microbatch_exposes_what_the_neighbour_does_not_hide():
    """Two blocks of 500 parameters, fp32, dp 2, 1 GB/s: each gather is half an all-reduce
    of 2 kB = 0.01 + 1e3 * 1e3 / 1e9 = 0.011 ms; block 0's F has nothing before it, block
    1's F hides under block 0's (1 ms), and the reverse in the backward."""
    profile = make_profile([make_block(f"layers.{i}", kind="decoder_layer", fwd_ms=1.0,
                                       bwd_ms=2.0, num_params=500) for i in range(2)])
    gathered = gather_per_microbatch(profile, 2, 4, 1e9, 0.01)
    first, second = gathered.blocks
    assert first.fwd_ms == pytest.approx(1.011) and second.fwd_ms == pytest.approx(1.0)
    assert first.bwd_input_ms == profile.blocks[0].bwd_input_ms
    assert second.bwd_input_ms == pytest.approx(profile.blocks[1].bwd_input_ms + 0.011)
    assert gather_per_microbatch(profile, 1, 4, 1e9, 0.01) is profile


def test_cli_dp_shard_per_microbatch_plans_fsdp_without_split_backward(tmp_path, capsys):
    """--dp-shard params-per-microbatch: the plan records FSDP gathered per microbatch, with
    a schedule the runtime can run that way (no zero-bubble split backward)."""
    path = tmp_path / "p.json"
    path.write_text(llama_like(4).to_json())
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--devices", "4", "--device", "h100", "--dp", "2",
                 "--tp", "1", "--microbatches", "4", "--dp-shard", "params-per-microbatch",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.from_json(out.read_text())
    assert (plan.zero_stage, plan.reshard_after_forward, plan.dp_size) == (3, True, 2)
    assert not SCHEDULES[plan.schedule].split_backward

def test_a_tp_shard_scales_every_byte_field():
    """The weight gradients in a block's workspace shard with its weights and stay within
    its workspace, the gradients held from B to W with its activations (a CPU profile of
    a tiny Qwen2 under tp 2 was refused 'adopted_grad_bytes > transient_bytes')."""
    base = _two_layers()
    blocks = tuple(dataclasses.replace(b, transient_bytes=1000, adopted_grad_bytes=1000,
                                       held_for_weight_bytes=340) for b in base.blocks)
    sharded = shard_profile(dataclasses.replace(base, blocks=blocks), 2,
                            bandwidth_bytes_per_s=1e9, latency_ms=0.01)
    for block, whole in zip(sharded.blocks, blocks):
        assert (block.transient_bytes, block.adopted_grad_bytes) == (500, 500)
        share = block.activation_bytes / whole.activation_bytes
        assert block.held_for_weight_bytes == round(340 * share) < 340


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_plans_only_what_the_runtime_shards(tied):
    """Under FSDP (zero 3, dp 2) the planner keeps halves whole and the head whole, and
    with a tied embedding and head runs no V schedule (one FSDP unit cannot span two stages
    of one rank), as ``autopart.runtime.fsdp`` requires; asking for a split head says so."""
    from families import tiny_config

    from autopart.intake.sources import build_hf_model
    from autopart.profile import profile_model
    from autopart.schedules import schedule_info
    from autopart.solve import make_plan

    model = build_hf_model(tiny_config("llama", tie_word_embeddings=tied))
    profile = profile_model(model, backend="analytical:h100", seq_len=64)
    assert profile.model.slice_units and profile.setup.granularity == "projection"
    free = plan_mesh(profile, devices=4, device="h100", tp_size=1, pp_size=2, dp_size=2,
                     num_microbatches=4, refine_evals=0).plan
    sharded = plan_mesh(profile, devices=4, device="h100", tp_size=1, pp_size=2, dp_size=2,
                        num_microbatches=4, zero_stage=3, refine_evals=0).plan
    assert free.zero_stage == 0 and sharded.zero_stage == 3
    assert sharded.head_shards == 0
    assert not any(parts and parts[-1].axis == "units" for parts in sharded.parts.values())
    assert any("FSDP shards each block's parameters" in n for n in sharded.notes)
    if tied:
        assert schedule_info(sharded.schedule).style == "loop"
    with pytest.raises(PlanError, match="cannot be sharded by FSDP"):
        make_plan(profile, pp_size=2, dp_size=2, zero_stage=3, split_head=True)


def test_a_tp_shard_at_the_profile_level_is_fused_to_the_layers_tp_plans():
    """``shard_of`` may return a shard at the profile's own (finer) level: tp > 1 plans
    whole layers, so the shard is fused to them rather than failing on a block count."""
    from families import tiny_config

    from autopart.intake.sources import build_hf_model
    from autopart.profile import profile_model
    from autopart.profile.tp_shard import profile_tp_shard

    profile = profile_model(build_hf_model(tiny_config("llama")), backend="analytical:h100",
                            seq_len=64)
    assert profile.setup.granularity == "projection"
    fine = plan_mesh(profile, devices=2, device="h100", tp_size=2, pp_size=1, dp_size=1,
                     num_microbatches=2, refine_evals=0,
                     shard_of=lambda tp: profile_tp_shard(profile, tp)).plan
    default = plan_mesh(profile, devices=2, device="h100", tp_size=2, pp_size=1, dp_size=1,
                        num_microbatches=2, refine_evals=0).plan
    assert fine.tp_size == 2 and fine.to_json() == default.to_json()

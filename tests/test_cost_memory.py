"""The memory model end to end (profile -> cost.stage_cost -> simulate), hand-worked.

Every figure below is worked out from the rules in ``autopart/cost/stage.py``: torch's
receive buffers per microbatch, the stage output held until its backward (the
logits for a causal LM's last stage), the first block's saved input living in the
receive buffer, the workspace on top of the held activations while a stage runs,
and recomputation of the layers only.
"""

from __future__ import annotations

import dataclasses

from autopart.cost.blocks import block_arrays, checkpointed
from autopart.cost.rank import rank_static_bytes
from autopart.cost.stage import stage_cost
from autopart.schema import (
    BlockProfile,
    ModelInfo,
    Part,
    Profile,
    ProfileSetup,
    TrainingSetup,
)
from autopart.simulate import simulate


def _block(name: str, kind: str, act: int, out: int, transient: int,
           params: int) -> BlockProfile:
    return BlockProfile(name=name, kind=kind, fwd_ms=1.0, bwd_ms=2.0, bwd_input_ms=1.0,
                        bwd_weight_ms=1.0, param_bytes=4 * params, activation_bytes=act,
                        output_bytes=out, transient_bytes=transient, num_params=params)


def _llm() -> Profile:
    """emb, two layers, head+loss; 1 x 2 tokens, vocabulary 8: logits of 2 * 8 * 4 = 64 B."""
    blocks = (_block("emb", "embedding", 8, 100, 50, 10),
              _block("l0", "decoder_layer", 400, 100, 60, 20),
              _block("l1", "decoder_layer", 400, 100, 60, 20),
              _block("head", "head", 300, 4, 500, 10))
    return Profile(model=ModelInfo(name="m", fingerprint="f", num_params=60, vocab_size=8),
                   setup=ProfileSetup(backend="cpu", device_name="cpu", dtype="float32",
                                      micro_batch_size=1, seq_len=2, torch_version="x"),
                   blocks=blocks)


SETUP = TrainingSetup(pp_size=2, num_microbatches=4, optimizer="none")
"""fp32 params + grads: 8 B per parameter."""


def test_1f1b_pp2_m4_by_hand():
    """Stage 0 = emb, l0; stage 1 = l1, head.

    Stage 0: static 30 * 8 = 240; holds 8 + 400 saved + its output 100 = 508 per
    microbatch; receives 4 gradient buffers of 100; workspace max(50, 60) = 60. Rank 0
    runs F0 F1 B0 F2 B1 F3 B2 B3: two microbatches held, so 240 + 400 + 2 * 508 + 60.
    Stage 1: static 240; holds 400 + 300 saved + the logits 64 - its input 100, which
    is the receive buffer; 4 activation buffers of 100; workspace 500. Rank 1 holds
    one microbatch: 240 + 400 + 664 + 500.
    """
    arrays = block_arrays(_llm(), SETUP)
    costs = [stage_cost(arrays, 0, 1), stage_cost(arrays, 2, 3)]
    assert [c.activation_bytes for c in costs] == [508, 664]
    assert [(c.input_bytes, c.output_bytes) for c in costs] == [(0, 100), (100, 0)]
    res = simulate(costs, schedule="1f1b", pp_size=2, virtual_stages=1, num_microbatches=4,
                   setup=SETUP)
    assert res.rank_peak_memory_bytes == (240 + 400 + 2 * 508 + 60, 240 + 400 + 664 + 500)


def test_gpipe_holds_every_microbatch_and_its_output():
    """GPipe rank 0 holds all 4 microbatches (508 each) before the first backward."""
    arrays = block_arrays(_llm(), SETUP)
    costs = [stage_cost(arrays, 0, 1), stage_cost(arrays, 2, 3)]
    res = simulate(costs, schedule="gpipe", pp_size=2, virtual_stages=1, num_microbatches=4,
                   setup=SETUP)
    assert res.rank_peak_memory_bytes == (240 + 400 + 4 * 508 + 60,
                                          240 + 400 + 4 * 664 + 500)


def test_first_backward_hands_its_weight_gradients_to_grad():
    """300 of the head's 500 workspace bytes are its weight gradient. GPipe's rank 1 runs
    F3 (computing no gradient) and B0 (its gradient becomes ``.grad``, static) with all 4
    microbatches held (664 each): 4 * 664 + 200; B1 pays the whole 500 with 3 held,
    less. 1F1B's rank 1 holds one microbatch, so its peak is B1's 664 + 500 as before."""
    blocks = list(_llm().blocks)
    blocks[3] = dataclasses.replace(blocks[3], adopted_grad_bytes=300)
    arrays = block_arrays(dataclasses.replace(_llm(), blocks=tuple(blocks)), SETUP)
    costs = [stage_cost(arrays, 0, 1), stage_cost(arrays, 2, 3)]
    assert [c.adopted_grad_bytes for c in costs] == [0, 300]
    gpipe = simulate(costs, schedule="gpipe", pp_size=2, virtual_stages=1, num_microbatches=4,
                     setup=SETUP)
    assert gpipe.rank_peak_memory_bytes[1] == 240 + 400 + 4 * 664 + 200
    one_f_one_b = simulate(costs, schedule="1f1b", pp_size=2, virtual_stages=1,
                           num_microbatches=4, setup=SETUP)
    assert one_f_one_b.rank_peak_memory_bytes[1] == 240 + 400 + 664 + 500


def test_zero_bubble_holds_the_weight_gradients_from_b_to_w():
    """ZBV on one rank (v = 2, m = 1) runs F0s0 F0s1 B0s1 W0s1 B0s0 W0s0. Stage 1 = l1,
    head keeps l1's 200 and the head's 100 gradient bytes from B to W but drops its
    logits (64) at B: 236 more while W0s1 runs (with stage 0's 508 and its workspace
    500). Stage 0 skips B in torch (its W runs the full backward): nothing more. Static
    480, buffers 100 + 100: 480 + 200 + 508 + 664 + 236 + 500."""
    blocks = list(_llm().blocks)
    blocks[2] = dataclasses.replace(blocks[2], held_for_weight_bytes=200)
    blocks[3] = dataclasses.replace(blocks[3], held_for_weight_bytes=100)
    blocks[1] = dataclasses.replace(blocks[1], held_for_weight_bytes=1000)
    profile = dataclasses.replace(_llm(), blocks=tuple(blocks))
    arrays = block_arrays(profile, SETUP)
    costs = [stage_cost(arrays, 0, 1), stage_cost(arrays, 2, 3)]
    assert [c.held_for_weight_bytes for c in costs] == [0, 236]
    res = simulate(costs, schedule="zbv", pp_size=1, virtual_stages=2, num_microbatches=1,
                   setup=SETUP)
    assert res.rank_peak_memory_bytes == (480 + 200 + 508 + 664 + 236 + 500,)
    one_f_one_b = simulate(costs[:1] + costs[1:], schedule="interleaved-1f1b", pp_size=1,
                           virtual_stages=2, num_microbatches=1, setup=SETUP)
    assert one_f_one_b.rank_peak_memory_bytes == (480 + 200 + 508 + 664 + 500,)


def test_recompute_checkpoints_layers_only():
    """Stage 1 under recompute: l1 keeps its input (100, the receive buffer, so 0 more),
    the head is not checkpointed and keeps its 300; + logits 64. The backward re-runs
    l1's forward only (1 ms), and rebuilds l1's 400 on top of the workspace 500."""
    assert [checkpointed(k) for k in ("embedding", "decoder_layer", "block", "norm", "head")] \
        == [False, True, True, False, False]
    cost = stage_cost(block_arrays(_llm(), SETUP), 2, 3, recompute=True)
    assert cost.activation_bytes == 100 + 300 + 64 - 100
    assert cost.bwd_input_ms == 2.0 + 1.0
    assert cost.transient_bytes == 500 + 400


def test_workspace_coincides_with_the_blocks_before_it():
    """A 1000-byte workspace in the embedding runs before (F) or after (B) l0 holds
    its 400: the stage needs 1000 - 400 = 600 on top of its activations, not 1000."""
    profile = _llm()
    emb = dataclasses.replace(profile.blocks[0], transient_bytes=1000)
    profile = dataclasses.replace(profile, blocks=(emb, *profile.blocks[1:]))
    arrays = block_arrays(profile, SETUP)
    assert stage_cost(arrays, 0, 1).transient_bytes == max(1000 - 400, 60)
    assert stage_cost(arrays, 1, 1).transient_bytes == 60


def _tied_llm(tied: bool) -> Profile:
    """``_llm`` whose embedding and head share a vocab 8 x hidden 1 weight (8 parameters)."""
    profile = _llm()
    model = dataclasses.replace(profile.model, tied_embeddings=tied, hidden_size=1)
    return dataclasses.replace(profile, model=model)


def test_tied_weight_counts_once_per_rank():
    """ZBV, pp 2, v 2, one block per stage: rank 0 holds stage 0 (emb) and stage 3
    (head), each 10 parameters * 8 B = 80 B of static, of which the shared 8 * 8 = 64 B
    is one Parameter in torch: rank 0's static is 80 + 80 - 64 = 96, rank 1's
    (l0, l1) 160 + 160 = 320 either way. A stage holding both counts it once too. Both
    stages say they hold the head's module (the shared weight) whole."""
    arrays = block_arrays(_tied_llm(True), SETUP)
    costs = [stage_cost(arrays, i, i) for i in range(4)]
    assert [c.held for c in costs] == [(("head", 64),), (), (), (("head", 64),)]
    assert [c.static_bytes for c in costs] == [80, 160, 160, 80]
    assert rank_static_bytes(costs, (0, 3)) == 96
    assert rank_static_bytes(costs, (1, 2)) == 320
    assert rank_static_bytes([stage_cost(arrays, 0, 3)], (0,)) == 60 * 8 - 64
    untied = block_arrays(_tied_llm(False), SETUP)
    assert rank_static_bytes([stage_cost(untied, i, i) for i in range(4)], (0, 3)) == 160
    kwargs = dict(schedule="zbv", pp_size=2, virtual_stages=2, num_microbatches=4,
                  setup=SETUP)
    peaks = simulate(costs, **kwargs).rank_peak_memory_bytes
    untied_peaks = simulate([stage_cost(untied, i, i) for i in range(4)],
                            **kwargs).rank_peak_memory_bytes
    assert (untied_peaks[0] - peaks[0], untied_peaks[1] - peaks[1]) == (64, 0)


def test_split_head_is_held_whole_on_every_rank_with_a_shard():
    """A head of vocab 8 x hidden 1 split into two shards of 4 parameters: a rank with
    one shard holds the whole weight, its gradient and state, 8 * 8 = 64 B, not 32 B.
    Tied as well, the embedding (2 own + the 8 shared parameters) holds that same
    weight: a rank with the embedding and a shard holds (2 + 8) * 8 = 80 B. Each stage
    with a shard holds it (its static bytes), a rank once."""
    profile = _tied_llm(False)
    head = profile.blocks[-1]
    shards = tuple(dataclasses.replace(head, name=f"head.shard{i}of2", num_params=4,
                                       parts=(Part(module="head", axis="vocab", index=i,
                                                   count=2),))
                   for i in range(2))
    profile = dataclasses.replace(profile, blocks=(*profile.blocks[:-1], *shards))
    costs = [stage_cost(block_arrays(profile, SETUP), i, i) for i in range(5)]
    assert [c.static_bytes for c in costs] == [80, 160, 160, 64, 64]
    assert costs[3].held == costs[4].held == (("head", 64),)
    assert rank_static_bytes(costs, (3,)) == 64
    assert rank_static_bytes(costs, (3, 4)) == 64
    assert rank_static_bytes(costs, (2, 4)) == 160 + 64
    tied = dataclasses.replace(profile, model=_tied_llm(True).model)
    costs = [stage_cost(block_arrays(tied, SETUP), i, i) for i in range(5)]
    assert rank_static_bytes(costs, (0, 4)) == 80
    assert rank_static_bytes(costs, (0,)) == 80
    assert rank_static_bytes(costs, (1, 3)) == 160 + 64


def test_first_stage_runs_its_whole_backward_as_w():
    """torch's split backward skips the first stage's B (its input, the token ids, needs
    no gradient) and runs the whole backward in W: B 0, W = every block's B + W there;
    a later stage keeps the split. The full backward is the same either way."""
    arrays = block_arrays(_llm(), SETUP)
    first, later = stage_cost(arrays, 0, 1), stage_cost(arrays, 2, 3)
    assert (first.bwd_input_ms, first.bwd_weight_ms) == (0.0, 4.0)
    assert (later.bwd_input_ms, later.bwd_weight_ms) == (2.0, 2.0)
    assert first.bwd_ms == later.bwd_ms == 4.0

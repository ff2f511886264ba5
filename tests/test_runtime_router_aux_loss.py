"""The MoE router's load-balancing loss trains exactly as in the unpipelined model.

Mixtral and Qwen3-MoE with ``output_router_logits=True`` and ``router_aux_loss_coef``
0.5 (large, so a wrong share shows): HF adds ``coef * load_balancing_loss_func(...)``
over every layer's router logits and the whole padded batch. On 2 gloo ranks, with a
cut between MoE layers and one inside a layer, under 1F1B, Interleaved 1F1B, ZBV with
recomputed layers and LoopedBFS with the head alone on the last stage, the loss and
every gradient must match within 1e-5 in fp32
(``autopart.runtime.aux_loss``: routing counted first, each stage adds its layers'
exact linear share), at the first step and at the second, which runs on the first's
shapes.
"""

from __future__ import annotations

import pytest
from families import reference_run, tiny_config
from runtime_helpers import check_exact, exact_step, make_stage_plan, run_ranks

from autopart.intake import discover_blocks
from autopart.intake.sources import build_hf_model
from autopart.runtime.builder import tied_parameters

TOL = 1e-5
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5, "router_jitter_noise": 0.0}
# half level: 0 embedding, layer i: 1 + 2i attention half, 2 + 2i MoE half; 9 norm, 10 head
# schedule -> (stage sizes, activation checkpointing): ZBV splits the backward (the counting
# pass is then a whole step whose gradients are dropped) and recomputes the layers
PLANS = {"1f1b": ([3, 8], False), "interleaved-1f1b": ([2, 3, 3, 3], False),
         "zbv": ([2, 3, 3, 3], True),
         # the last stage holds the head alone: no router there (HF's own loss, were it
         # left on, would read an empty tuple of logits)
         "looped-bfs": ([2, 3, 5, 1], False)}


def _worker(rank: int, world_size: int, model_type: str) -> dict:
    config = tiny_config(model_type, **AUX)
    reference = reference_run(config)
    chain = discover_blocks(build_hf_model(config), granularity="half")
    aliases = {b: a for a, b in tied_parameters(build_hf_model(config), chain)}
    results = {"ref_loss": reference.loss, "ref_keys": sorted(reference.state)}
    for schedule, (counts, recompute) in PLANS.items():
        plan = make_stage_plan(chain, counts, schedule=schedule, pp_size=world_size,
                               num_microbatches=4)
        results[schedule] = exact_step(config, plan, reference, aliases, recompute, steps=2)
    return results


def test_reference_includes_the_aux_loss():
    """The reference differs from the token loss alone (else the test could not fail)."""
    with_aux = reference_run(tiny_config("mixtral", **AUX)).loss
    without = reference_run(tiny_config("mixtral", router_jitter_noise=0.0)).loss
    assert with_aux - without > 0.1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_trains_exactly(tmp_path, model_type):
    """Loss and every gradient (routers included) match the unpipelined model's, at the
    second step too, which takes the first step's shapes: torch no longer infers them
    again at each switch between the counting pass and training (``STATIC``)."""
    results = run_ranks(_worker, 2, tmp_path, model_type)
    check_exact(results, PLANS, TOL)
    for schedule in ("1f1b", "interleaved-1f1b", "looped-bfs"):  # ZBV's pass: a whole step
        assert all("STATIC" in mode for r in results for mode in r[schedule]["modes"]), \
            (schedule, [r[schedule]["modes"] for r in results])

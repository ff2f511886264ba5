"""FSDP2 under pipeline parallelism: ``fully_shard`` per block over the ``dp`` axis.

A plan with ``zero_stage`` 3 (``autopart plan --dp-shard params-per-step`` or
``params-per-microbatch``) shards every parameter, gradient and optimizer state over
the data-parallel replicas, as torchtitan composes FSDP with pipeline parallelism
(``torchtitan/distributed/pipeline_parallel.py``, ``parallelize.py``): each block of a
stage is one ``fully_shard`` unit over the ``dp`` dimension of the ``("pp", "dp",
"tp")`` mesh (a tensor-parallel block's ``DTensor`` parameters become 2-D), and the
stage module is the root. torch's schedules then drive it
(``torch.distributed.pipelining.stage``): every backward runs without gradient sync
and keeps the parameters gathered, and after a stage's last backward of the step
(``REDUCE_GRAD``) its gradients are reduce-scattered once and its parameters
resharded; the multi-stage schedules issue ``UNSHARD`` / ``RESHARD`` around the
compute with the next stages' all-gathers prefetched.

``reshard_after_forward`` is the plan's choice: off (``params-per-step``, torchtitan's
default under PP), a stage's parameters are gathered once per step; on
(``params-per-microbatch``), they are freed after each forward and gathered again for
the backward. Mixed precision follows the plan's precision: low-precision compute
weights gathered from the sharded float32 ones, gradients reduced in the gradient
dtype (``MixedPrecisionPolicy``).

The built-in loss is the token mean over every replica's tokens, so gradients are
summed over the replicas (divide factor 1); a custom ``loss_fn``'s are averaged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from autopart.errors import RuntimeSetupError
from autopart.intake import BlockChain
from autopart.runtime.planned import base_names
from autopart.schedules import schedule_info
from autopart.schema import Plan, StagePlan, TrainingSetup

__all__ = []

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mixed_precision(setup: TrainingSetup) -> MixedPrecisionPolicy:
    """FSDP's policy for the plan's precision: with fp32 master weights, compute in the
    parameter dtype and reduce in the gradient dtype; otherwise as the parameters are."""
    if setup.master_weights and setup.param_dtype != "float32":
        return MixedPrecisionPolicy(param_dtype=_DTYPES[setup.param_dtype],
                                    reduce_dtype=_DTYPES[setup.grad_dtype])
    return MixedPrecisionPolicy()


def check_fsdp(plan: Plan, ties: list[tuple[str, str]], chain: BlockChain,
               *, split_head: bool, where: str = "the plan") -> None:
    """Raise ``RuntimeSetupError`` for what FSDP here cannot shard, before any collective.

    A weight held whole on several stages of one rank (the head split by vocabulary, a
    half cut into slices, a tied embedding and head on one rank) would sit in two FSDP
    units; each gets one line naming the remedy.
    """
    if plan.zero_stage != 3:
        return
    if plan.reshard_after_forward and schedule_info(plan.schedule).split_backward:
        raise RuntimeSetupError(f"{where} gathers parameters per microbatch (FSDP "
                                f"reshard_after_forward) under {plan.schedule}, whose weight "
                                f"gradients (W) run apart from the backward after the "
                                f"parameters were freed; use --dp-shard params-per-step or "
                                f"a schedule without split backward (1f1b, interleaved-1f1b)")
    if split_head:
        raise RuntimeSetupError(f"{where} splits the head by vocabulary across stages and "
                                f"shards parameters over dp (FSDP); plan the head whole "
                                f"(--head whole) or with --dp-shard optimizer")
    if any(parts and parts[-1].axis == "units" for parts in plan.parts.values()):
        raise RuntimeSetupError(f"{where} cuts a layer half into slices and shards parameters "
                                f"over dp (FSDP); plan without slices or with --dp-shard "
                                f"optimizer")
    stage_of = {m: s.index for s in plan.stages for m in base_names(plan, chain, s.modules)}
    first, last = stage_of[chain.blocks[0].name], stage_of[chain.blocks[-1].name]
    if ties and first != last and plan.stages[first].rank == plan.stages[last].rank:
        raise RuntimeSetupError(f"{where} puts the tied embedding and head on one rank in "
                                f"two stages ({plan.schedule}); FSDP cannot shard one weight "
                                f"in two units: use a schedule with loop placement (1f1b, "
                                f"interleaved-1f1b) or --dp-shard optimizer")


def apply_fsdp(stage_modules: list[nn.Module], stages: list[StagePlan], chain: BlockChain,
               mesh: DeviceMesh, *, reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy, sum_replicas: bool) -> None:
    """``fully_shard`` each block of each stage over ``mesh``, then the stage as the root.

    Args:
        stage_modules: This rank's stage modules (``autopart.runtime.stages``).
        stages: Their stage plans, each block named by its chain block (derived parts
            replaced by their base, ``autopart.runtime.planned.base_names``).
        chain: The block chain (each block's module FQNs).
        mesh: The 1-D data-parallel mesh.
        reshard_after_forward: Free gathered parameters after each forward.
        mp_policy: FSDP's mixed-precision policy (``mixed_precision``).
        sum_replicas: Sum the replicas' gradients (the built-in loss) instead of
            averaging them.
    """
    blocks = {b.name: b for b in chain.blocks}
    for module, stage in zip(stage_modules, stages):
        units = []
        for name in dict.fromkeys(stage.modules):
            parts = [module.get_submodule(f) for f in blocks[name].fqns]
            if any(True for part in parts for _ in part.parameters()):
                units.append(fully_shard(parts if len(parts) > 1 else parts[0], mesh=mesh,
                                         reshard_after_forward=reshard_after_forward,
                                         mp_policy=mp_policy))
        root = fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                           mp_policy=mp_policy)
        for unit in [*_flat(units), root]:
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM / AVG
            if sum_replicas:
                unit.set_gradient_divide_factor(1.0)


def _flat(units: list) -> list[FSDPModule]:
    """``fully_shard`` returns one module, or a list for a group of modules."""
    return [u for unit in units for u in (unit if isinstance(unit, list) else [unit])]

"""The torch side of a plan's stages: ``PipelineStage`` objects and the schedule.

``autopart.runtime.stages`` builds the stage modules (``ForwardStage``); here they are
wrapped as torch's ``PipelineStage`` (``wrap_stages``, shape inference on zeros) and
driven by the schedule the plan names (``build_schedule``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from autopart.schedules import schedule_info
from autopart.schema import Plan, StagePlan

__all__ = []


def wrap_stages(modules: list[nn.Module], stages: list[StagePlan], num_stages: int,
                device: torch.device, group: dist.ProcessGroup) -> list[PipelineStage]:
    """``PipelineStage`` objects (shapes inferred at the first step)."""
    return [_ZeroedInferenceStage(module, stage.index, num_stages, device, group=group)
            for module, stage in zip(modules, stages)]


class _ZeroedInferenceStage(PipelineStage):
    """A ``PipelineStage`` whose shape inference runs the stage on zeros.

    torch infers a later stage's output shapes by running it on tensors made from the
    received metadata, left uninitialized: integers received there (Hy-V4's top-k token
    indices, passed from layer to layer) then index out of bounds. Zeros are valid
    indices and finite values."""

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        """torch's tensor for ``arg`` (a tensor, or metadata to make one from), zeroed
        when made from metadata."""
        made = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and type(made) is torch.Tensor:
            with torch.no_grad():
                made.zero_()
        return made


def keep_inferred_shapes(stages: list[PipelineStage]) -> None:
    """Make every later initialization of ``stages`` take the shapes torch inferred at the
    first step.

    torch infers a stage's shapes again whenever its schedule switches between
    forward-only and training: a real forward of one microbatch, then a forward and
    backward for the gradients' shapes, stage after stage along the pipeline. The router
    loss's counting pass (``schedule.eval`` before each ``step``) switches twice a step.
    With every stage's metadata given as the user's, torch's vote picks its STATIC mode,
    which skips the inference (the shapes of a step do not change from step to step)."""
    for stage in stages:
        inferred, given = stage._stage_meta, stage._user_meta
        given.inputs, given.outputs = inferred.inputs, inferred.outputs
        given.input_grads, given.output_grads = inferred.input_grads, inferred.output_grads


def build_schedule(plan: Plan, stages: list[PipelineStage],
                   loss_fn: Callable[..., torch.Tensor], *, scale_grads: bool):
    """The torch schedule object named by ``plan.schedule``."""
    info = schedule_info(plan.schedule)
    cls = getattr(torch_schedules, info.torch_class)
    if info.multi_stage:
        return cls(stages, n_microbatches=plan.num_microbatches, loss_fn=loss_fn,
                   scale_grads=scale_grads)
    (stage,) = stages
    return cls(stage, n_microbatches=plan.num_microbatches, loss_fn=loss_fn,
               scale_grads=scale_grads)

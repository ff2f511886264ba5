"""Runtime: run a Plan on ``torch.distributed.pipelining`` with the original FQNs.

``auto_pipeline(model, plan=...)`` builds only this rank's stages and returns a
``PipelinedModel`` whose ``step`` trains one batch with the plan's schedule;
``CausalLMLoss`` is the built-in loss (what ``target`` means: ``autopart.runtime.loss``).
``save_checkpoint`` / ``load_checkpoint`` write and read torch.distributed.checkpoint
directories keyed by the unpipelined model's FQNs.
"""

from autopart.runtime.builder import auto_pipeline
from autopart.runtime.checkpoint import load_checkpoint, save_checkpoint
from autopart.runtime.loss import CausalLMLoss
from autopart.runtime.options import RuntimeOptions
from autopart.runtime.pipeline import PipelinedModel

# Public entry points; everything else in this package is internal.
__all__ = ["CausalLMLoss", "PipelinedModel", "RuntimeOptions", "auto_pipeline", "load_checkpoint",
           "save_checkpoint"]

"""autopart: automatic pipeline parallelism for PyTorch training.

Profile every block of a model on the target device, solve for the pipeline cuts,
virtual stages, schedule and microbatch count that give the fastest step within
each device's memory, and run that plan on ``torch.distributed.pipelining``::

    profile = autopart.profile_model("llama-3-8b", backend="analytical:h100", seq_len=4096)
    plan = autopart.make_plan(profile, autopart.PlanOptions(pp_size=8, num_microbatches=32))
    model = autopart.auto_pipeline("llama-3-8b", plan=plan)  # under torchrun

The names below are the public API, one per step of that flow; each phase's
package (``autopart.profile``, ``autopart.solve``, ...) exports a few more for
tools that want one piece. Heavy submodules (torch, transformers, pulp) load on
first use of a name.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopart.errors import AutopartError, InfeasibleError
from autopart.schema import Plan, Profile

__version__ = "0.1.0"

# Public entry points, by the module that defines them; loaded lazily.
_LAZY = {
    "profile_model": "autopart.profile",
    "ProfileOptions": "autopart.profile",
    "make_plan": "autopart.solve",
    "PlanOptions": "autopart.solve",
    "export_plan": "autopart.export",
    "simulate_plan": "autopart.simulate",
    "auto_pipeline": "autopart.runtime",
    "RuntimeOptions": "autopart.runtime",
    "CausalLMLoss": "autopart.runtime",
    "save_checkpoint": "autopart.runtime",
    "load_checkpoint": "autopart.runtime",
    "verify_plan": "autopart.verify",
    "RunSettings": "autopart.verify",
    "calibrate_profile": "autopart.verify",
}

# The public API: profile -> plan -> export or simulate -> train (with the built-in loss)
# -> verify -> calibrate, each step's typed options, the two data files, and the errors a
# caller tells apart (all are AutopartError).
__all__ = [
    "AutopartError",
    "CausalLMLoss",
    "InfeasibleError",
    "Plan",
    "PlanOptions",
    "Profile",
    "ProfileOptions",
    "RunSettings",
    "RuntimeOptions",
    "__version__",
    "auto_pipeline",
    "calibrate_profile",
    "export_plan",
    "load_checkpoint",
    "make_plan",
    "profile_model",
    "save_checkpoint",
    "simulate_plan",
    "verify_plan",
]
assert set(_LAZY) <= set(__all__)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopart' has no attribute {name!r}")


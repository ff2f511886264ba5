"""autopart: automatic pipeline parallelism for PyTorch training.

Profile every block of a model on the target device, solve for the pipeline cuts,
virtual stages, schedule and microbatch count that give the fastest step within
each device's memory, and run that plan on ``torch.distributed.pipelining``.
"""

from autopart.errors import (
    AutopartError,
    InfeasibleError,
    ModelSourceError,
    PlanError,
    ProfileError,
    RuntimeSetupError,
    SchemaError,
)
from autopart.schema import BlockProfile, Plan, Profile, TrainingSetup

__version__ = "0.1.0"

# Public entry points; everything else is internal.
__all__ = [
    "AutopartError",
    "BlockProfile",
    "InfeasibleError",
    "ModelSourceError",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "RuntimeSetupError",
    "SchemaError",
    "TrainingSetup",
    "__version__",
]

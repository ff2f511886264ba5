"""The autopart error family: one clear line for the user, exit code 2 in the CLI."""

from __future__ import annotations

__all__ = [
    "unknown_field",
    "AutopartError",
    "InfeasibleError",
    "ModelSourceError",
    "PlanError",
    "ProfileError",
    "RuntimeSetupError",
    "SchemaError",
]


class AutopartError(ValueError):
    """Base of every error a user can cause.

    The message is one line: what was wrong, the value seen, what was expected
    and what to do. The CLI prints it as is and exits with code 2.
    """


class ModelSourceError(AutopartError):
    """A model source (preset, config path, hub id, factory) cannot be turned into a model."""


class ProfileError(AutopartError):
    """Profiling settings are invalid (backend, dtype, shapes) or profiling failed."""


class SchemaError(AutopartError):
    """A JSON file (profile, plan, run report) is malformed or of an unknown version."""


class PlanError(AutopartError):
    """Planner settings are invalid (pp size, microbatches, schedule, ...)."""


class InfeasibleError(PlanError):
    """No plan fits the memory limit; the message says what would fit."""

    def __init__(self, message: str, needed_bytes: int | None = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        """The smallest per-device limit that fits, when the planner worked it out."""


class RuntimeSetupError(AutopartError):
    """The runtime cannot run this plan here (world size, fingerprint, loss_fn, ...)."""


def unknown_field(cls: type, fields: dict) -> tuple[str, str] | None:
    """The first of ``fields`` that the dataclass ``cls`` does not have, and its field
    names joined for a one-line error (``None`` when every field exists)."""
    import dataclasses

    names = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(fields) - set(names))
    return (unknown[0], ", ".join(names)) if unknown else None

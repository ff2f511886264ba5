"""``PlanOptions``: everything a plan is asked for, in one typed object.

The command line (``autopart plan``), ``make_plan``, the mesh search and
``auto_pipeline(plan="auto")`` all take it, so the same inputs give the same plan. What
a caller leaves out defaults from the profile: the memory limit and the pipeline link
from the profile's device (``device_of``), the precision from its dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopart.errors import PlanError, ProfileError, unknown_field
from autopart.profile.devices import DeviceSpec, list_devices, load_device_spec, parse_backend
from autopart.schema import ZERO_STAGES, Profile

__all__ = ["DEVICE", "GRANULARITY_CHOICES", "PlanOptions"]

DEVICE = "device"
"""``PlanOptions.memory_limit_bytes``' default: the profile's device's memory."""
GRANULARITY_CHOICES = ("auto", "layer", "half", "projection", "slice", "sublayer", "quarter")
"""``auto`` (every level the profile offers, the fastest plan), a level, or a schema 1 name
of one (``sublayer`` = ``half``, ``quarter`` = ``projection``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """What to plan and how (``make_plan``); every field has a default but the size."""

    pp_size: int | None = None
    """Pipeline ranks (required unless ``devices`` is given)."""
    devices: int | None = None
    """Plan the tp x pp x dp mesh of this many devices instead (``autopart.solve.mesh``)."""
    tp_size: int | str = "auto"
    """With ``devices``: tensor-parallel size, or ``auto``."""
    dp_size: int | str = "auto"
    """Data-parallel replicas: with ``devices`` a size or ``auto``; with ``pp_size`` alone
    an integer (the plan's gradient sync and ZeRO share), default 1."""
    zero_stage: int = 0
    """What the data-parallel replicas shard (``TrainingSetup.zero_stage``): 0 nothing, 1
    the optimizer state (ZeRO-1), 3 parameters, gradients and optimizer state (FSDP)."""
    reshard_after_forward: bool = False
    """With ``zero_stage`` 3: gather parameters per microbatch (in every F and B) instead of
    once per stage and step."""
    sequence_parallel: bool = True
    """With ``devices``: tensor parallelism with sequence parallelism."""
    num_microbatches: int | None = None
    """Fix m; else every divisor of ``global_batch_size`` is searched, or m = 4 * pp."""
    global_batch_size: int | None = None
    """Samples per step (per replica with ``pp_size``; over all replicas with ``devices``)."""
    schedule: str | tuple[str, ...] = "auto"
    """A schedule name, several, or ``auto`` (every schedule torch has)."""
    virtual_stages: int | str = "auto"
    """Stages per rank, or ``auto``."""
    granularity: str = "auto"
    """``auto`` (every level the profile offers, head whole or split: the fastest), or one
    level of ``autopart.schema.parts.LEVELS`` (the head split where it can be, except at
    ``layer``)."""
    split_head: bool | None = None
    """Cut the head by vocabulary: ``None`` (the default) where faster, ``True`` where it
    can be cut, ``False`` never (a custom loss needs the logits whole)."""
    cuts: tuple[str, ...] | None = None
    """Evaluate this split instead of searching: ``pp * v - 1`` cut names in model order
    (``autopart.solve.cuts``); the level follows the names."""
    partition: str = "optimal"
    """``optimal``, or a public baseline split (``even``, ``params``, ``torchtitan``)."""
    target: str | None = None
    """An export format (``nxd``, ``megatron``, ...): plan within its rules."""
    cut_kinds: tuple[str, ...] | None = None
    """Cut only after blocks of these kinds (default: the target's)."""
    memory_limit_bytes: int | str | None = DEVICE
    """Per-device memory: bytes, ``None`` for unlimited, or ``device`` (the default): the
    capacity of ``device`` or of the profile's device (``memory_limit_of``)."""
    device: str | DeviceSpec | None = None
    """A device spec or its key in ``profiles/devices.json`` (``h100``, ``trn1``, ...) for
    the memory, links and node size; default: the profile's device (``device_of``)."""
    allow_recompute: bool = True
    """Let stages recompute their forward to fit memory."""
    optimizer: str = "adam"
    """``adam``, ``sgd`` or ``none`` (optimizer state per parameter)."""
    precision: str | None = None
    """A ``PRECISIONS`` preset; default: plain training in the profile's dtype."""
    link_bandwidth_bytes_per_s: float | None = None
    """Pipeline link; default: the device's, the profile's machine check, else 50 GB/s."""
    link_latency_ms: float | None = None
    """Pipeline link latency; default as the bandwidth."""
    solver: str = "auto"
    """``auto`` (DP, plus the ILP for small multi-stage problems), ``dp`` or ``ilp``."""
    ilp_backend: str = "auto"
    """``auto``, ``highs`` or ``cbc``."""
    ilp_max_nodes: int | None = None
    """Branch-and-bound nodes per ILP (default 100,000 with ``ilp``, 2,000 with ``auto``)."""
    ilp_time_limit_s: float | None = None
    """An optional wall-clock limit per ILP as well."""
    refine_evals: int = 300
    """Simulations the local search may spend per refined candidate (0: none)."""

    def __post_init__(self) -> None:
        if self.devices is None and self.pp_size is None:
            raise PlanError("give pp_size (--pp N), or devices (--devices N) to plan the "
                            "tp x pp x dp mesh")
        for name in ("pp_size", "devices", "num_microbatches", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise PlanError(f"zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}")
        if self.granularity not in GRANULARITY_CHOICES:
            raise PlanError(f"unknown granularity {self.granularity!r}; choose one of "
                            f"{', '.join(GRANULARITY_CHOICES[:5])}")
        if self.cuts is not None and self.devices is not None:
            raise PlanError("cuts fix one pipeline's split: give them with pp_size (--pp), "
                            "not devices")
        limit = self.memory_limit_bytes
        if limit is not None and limit != DEVICE and (
                isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise PlanError(f"memory_limit_bytes must be a positive integer, None or "
                            f"{DEVICE!r}, got {limit!r}")

    @classmethod
    def of(cls, options: PlanOptions | None = None, **fields: Any) -> PlanOptions:
        """``options`` with ``fields`` replaced (a new object from ``fields`` alone).

        Raises:
            PlanError: A field that ``PlanOptions`` does not have, or a bad value.
        """
        unknown = unknown_field(cls, fields)
        if unknown:
            raise PlanError(f"unknown plan option {unknown[0]!r}; options are {unknown[1]}")
        for key in ("cuts", "cut_kinds", "schedule"):
            value = fields.get(key)
            if isinstance(value, Sequence) and not isinstance(value, str):
                fields[key] = tuple(value)
        return cls(**fields) if options is None else dataclasses.replace(options, **fields)


def device_of(profile: Profile, device: str | DeviceSpec | None = None) -> DeviceSpec | None:
    """The spec of the device a profile plans for: ``device`` if given, the analytical
    backend's device, or the spec whose name the measured device's name matches (a CUDA
    or NeuronCore profile); ``None`` on CPU or an unknown accelerator.

    Raises:
        PlanError: ``device`` is not in ``profiles/devices.json``.
    """
    if isinstance(device, DeviceSpec):
        return device
    if device is not None:
        try:
            return load_device_spec(device)
        except ProfileError as exc:
            raise PlanError(str(exc)) from None
    backend = parse_backend(profile.setup.backend)
    if backend.device is not None:
        return load_device_spec(backend.device)
    if backend.kind == "cpu":
        return None
    name = profile.setup.device_name.lower()
    found = [key for key in list_devices() if key in name.replace(" ", "").replace("-", "")]
    return load_device_spec(found[0]) if len(found) == 1 else None


def memory_limit_of(profile: Profile, options: PlanOptions,
                    spec: DeviceSpec | None) -> int | None:
    """The per-device memory limit ``options`` asks for: its bytes or ``None``, or for
    ``device``: the spec's memory, else the profiled device's (``ProfileSetup.
    device_memory_bytes``: a GPU's memory, the CPU machine's RAM), else unlimited."""
    if options.memory_limit_bytes != DEVICE:
        return options.memory_limit_bytes  # type: ignore[return-value]
    if spec is not None:
        return spec.memory_bytes
    return profile.setup.device_memory_bytes or None

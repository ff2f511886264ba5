"""A plan request resolved against its profile: defaults filled, export rules applied."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopart.errors import PlanError
from autopart.profile.devices import DeviceSpec
from autopart.schedules import SCHEDULES, schedule_info
from autopart.schema import Profile, default_precision
from autopart.solve.options import PlanOptions, device_of, memory_limit_of
from autopart.solve.records import Options
from autopart.targets import planning_constraints

__all__ = []

_ILP_MAX_NODES = 100_000
_ILP_AUTO_MAX_NODES = 2_000
"""Per-ILP node limits for ``solver="ilp"`` and ``solver="auto"`` (a limit hit is reported
with its gap in ``Plan.solver``; under ``auto`` such a split is dropped)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """``PlanOptions`` with what the profile decides filled in."""

    options: PlanOptions
    """What was asked."""
    spec: DeviceSpec | None
    """The device planned for (``options.device``, else the profile's), if known."""
    memory_limit_bytes: int | None
    """Per-device memory (``None``: unlimited)."""
    setup_fields: dict[str, Any]
    """``TrainingSetup`` fields: optimizer, precision, links, data parallelism."""
    schedule: str | Sequence[str]
    """The schedules to search (an export target's only)."""
    cut_kinds: Sequence[str] | None
    """Block kinds a stage may end after (an export target's), or ``None``: any."""
    virtual_stages: int | str
    """v, or ``auto``."""
    search: Options
    """How the search runs (solver, ILP limits, local search)."""


def resolve_request(profile: Profile, options: PlanOptions) -> Request:
    """``options`` with its defaults taken from ``profile`` and its export target's rules.

    Raises:
        PlanError: A bad option value (v, device, target, link, dp size).
    """
    if options.pp_size is None:
        raise PlanError("give pp_size (--pp N) to plan one pipeline")
    spec = device_of(profile, options.device)
    setup: dict[str, Any] = {"optimizer": options.optimizer,
                             "precision": options.precision
                             or default_precision(profile.setup.dtype),
                             "zero_stage": options.zero_stage,
                             "reshard_after_forward": options.reshard_after_forward}
    dp = options.dp_size
    if dp != "auto":
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise PlanError(f"dp_size must be a positive integer, got {dp!r}")
        setup["dp_size"] = dp
    for key, spec_value in (("link_bandwidth_bytes_per_s", "link_bandwidth_bytes_per_s"),
                            ("link_latency_ms", "link_latency_ms")):
        value = getattr(options, key)
        if value is None and spec is not None:
            value = getattr(spec, spec_value)
        if value is not None:
            setup[key] = value
    virtual = options.virtual_stages
    if virtual != "auto" and (isinstance(virtual, bool) or not isinstance(virtual, int)
                              or virtual < 1):
        raise PlanError(f"virtual_stages must be 'auto' or an integer >= 1, got {virtual!r}")
    schedule: str | Sequence[str] = options.schedule
    cut_kinds = options.cut_kinds
    if options.target is not None:
        rules = planning_constraints(options.target)
        schedule = rules.schedules_for(schedule, pp_size=options.pp_size,
                                       num_microbatches=options.num_microbatches)
        cut_kinds = rules.cut_kinds if cut_kinds is None else cut_kinds
    if options.zero_stage == 3 and setup.get("dp_size", 1) > 1:
        schedule = _fsdp_schedules(profile, options, schedule)
    max_nodes = options.ilp_max_nodes
    if max_nodes is None:
        # Under "auto" the ILP is a second opinion beside the DP: keep it short.
        max_nodes = _ILP_MAX_NODES if options.solver == "ilp" else _ILP_AUTO_MAX_NODES
    search = Options(partition=options.partition, solver=options.solver,
                     allow_recompute=options.allow_recompute, ilp_backend=options.ilp_backend,
                     ilp_max_nodes=max_nodes, ilp_time_limit_s=options.ilp_time_limit_s,
                     refine_evals=options.refine_evals)
    return Request(options=options, spec=spec,
                   memory_limit_bytes=memory_limit_of(profile, options, spec),
                   setup_fields=setup, schedule=schedule, cut_kinds=cut_kinds,
                   virtual_stages=virtual, search=search)


def _fsdp_schedules(profile: Profile, options: PlanOptions,
                    schedule: str | Sequence[str]) -> tuple[str, ...]:
    """The schedules the runtime's FSDP runs (``autopart.runtime.fsdp``): not split backward
    when parameters are gathered per microbatch (W would run after they were freed), and
    not V placement when the embedding and head share a weight (one FSDP unit cannot span
    the first and last stage on one rank)."""
    names = list(SCHEDULES) if schedule == "auto" else [schedule] if isinstance(schedule, str) \
        else list(schedule)
    infos = [schedule_info(n) for n in names]
    kept = tuple(i.name for i in infos
                 if not (options.reshard_after_forward and i.split_backward)
                 and not (profile.model.tied_embeddings and options.pp_size > 1
                          and i.style != "loop"))
    if not kept:
        why = "gathering parameters per microbatch runs no split-backward schedule" \
            if options.reshard_after_forward else \
            "a tied embedding and head cannot be one FSDP unit in two stages of one rank"
        raise PlanError(f"FSDP cannot run schedule(s) {', '.join(names)}: {why}; use 1f1b or "
                        f"interleaved-1f1b, or --dp-shard optimizer")
    return kept

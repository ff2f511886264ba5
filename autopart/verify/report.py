"""``RunReport``: what a real run of a plan measured, beside what the plan predicted (JSON).

The report is written by ``autopart verify --json`` and read by ``calibrate_profile``
(``autopart calibrate``). Figures are per microbatch for stage times (medians over
every timed step and microbatch), per step for step and busy times (medians over
the timed steps) and per rank for memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopart.errors import SchemaError
from autopart.schema import Plan, dump_json

__all__ = ["REPORT_SCHEMA_VERSION", "RankReport", "RunReport", "StageReport", "plan_digest"]

REPORT_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReport:
    """One stage: predicted and measured time per microbatch."""

    index: int
    rank: int
    modules: tuple[str, ...]
    """Block FQNs of the stage, in order."""
    predicted_fwd_ms: float
    measured_fwd_ms: float
    """Forward, plus the loss on the last stage (the profile counts the loss in the head)."""
    predicted_bwd_ms: float
    """Full backward B + W."""
    measured_bwd_ms: float
    predicted_bwd_input_ms: float = 0.0
    measured_bwd_input_ms: float | None = None
    """B alone; measured only under split-backward (zero-bubble) schedules."""
    predicted_bwd_weight_ms: float = 0.0
    measured_bwd_weight_ms: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RankReport:
    """One rank: predicted and measured peak memory, busy and waiting time per step."""

    rank: int
    stages: tuple[int, ...]
    predicted_peak_memory_bytes: int
    measured_peak_memory_bytes: int
    predicted_busy_ms: float
    measured_busy_ms: float
    """Sum of this rank's F/B/W (and loss) spans in a step."""
    predicted_idle_ms: float
    measured_wait_ms: float
    """Time blocked in send/receive waits in a step."""
    measured_optimizer_ms: float = 0.0
    """``optimizer.step()`` after the pipeline step (not part of the predicted step)."""
    measured_cpu_ms: float = 0.0
    """Process CPU time during the pipeline step (CPU runs): busy + wait well above it
    means the rank was descheduled, i.e. the machine was shared."""
    memory: dict[str, int] = field(default_factory=dict)
    """Measured parts: ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``,
    ``buffer_bytes`` (recv buffers), ``live_peak_bytes`` (tensors alive during the step)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunReport:
    """A plan run for real: predicted vs measured (``autopart verify --json``)."""

    plan_fingerprint: str
    """The plan's ``profile_fingerprint`` (the model the plan is for)."""
    plan_digest: str
    """Hash of the plan JSON: calibration checks it is given the plan that ran."""
    model: str
    schedule: str
    pp_size: int
    virtual_stages: int
    num_microbatches: int
    micro_batch_size: int
    seq_len: int
    steps: int
    warmup: int
    device: str
    num_threads_per_rank: int
    memory_method: str
    predicted_step_ms: float
    measured_step_ms: float
    """Median over timed steps of the slowest rank's pipeline step (forward + backward of
    every microbatch and gradient sync; the optimizer step is reported apart)."""
    measured_step_ms_spread: float
    """(p75 - p25) / median of the measured step times."""
    measured_train_step_ms: float
    """Median pipeline step + optimizer step (slowest rank)."""
    stages: tuple[StageReport, ...]
    ranks: tuple[RankReport, ...]
    measured_events: tuple[tuple[Any, ...], ...] = ()
    """(rank, kind, stage, microbatch, start_ms, end_ms) of the median step, for traces."""
    schema_version: int = REPORT_SCHEMA_VERSION

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return relative_error(self.predicted_step_ms, self.measured_step_ms)

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys)."""
        return dump_json(self)

    def save(self, path: str | Path) -> None:
        """Write the report as JSON."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> RunReport:
        """Read a report written by ``save``; ``SchemaError`` names the file and the key."""
        p = Path(path)
        if not p.is_file():
            raise SchemaError(f"run report {p} does not exist; write one with "
                              f"`autopart verify PLAN --model MODEL --json {p}`")
        return cls.from_json(p.read_text(), str(p))

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> RunReport:
        """Parse JSON text; ``source`` names the file in error messages."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{source} is not valid JSON ({exc.msg}); rerun autopart verify "
                              f"--json") from None
        if not isinstance(data, dict) or data.get("schema_version") != REPORT_SCHEMA_VERSION:
            version = data.get("schema_version") if isinstance(data, dict) else None
            raise SchemaError(f"{source} has run report schema_version {version!r}, expected "
                              f"{REPORT_SCHEMA_VERSION}; rerun autopart verify --json")
        data["stages"] = tuple(_build(StageReport, s, source, "stages") for s in
                               _list(data, "stages", source))
        data["ranks"] = tuple(_build(RankReport, r, source, "ranks") for r in
                              _list(data, "ranks", source))
        data["measured_events"] = tuple(tuple(e) for e in data.get("measured_events", ()))
        return _build(cls, data, source, "top level")


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; 0 when nothing was measured."""
    return (predicted - measured) / measured if measured else 0.0


def plan_digest(plan: Plan) -> str:
    """Short hash of the plan's canonical JSON."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


def _list(data: dict, key: str, source: str) -> list:
    value = data.get(key)
    if not isinstance(value, list):
        raise SchemaError(f"{source} is missing list {key!r}; rerun autopart verify --json")
    return value


def _build(cls: type, data: Any, source: str, where: str) -> Any:
    if not isinstance(data, dict):
        raise SchemaError(f"{source}: {where} should be an object; rerun autopart verify --json")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SchemaError(f"{source} is missing key {f.name!r} in {where}; rerun "
                              f"autopart verify --json")
    return cls(**kwargs)

"""``autopart plan --devices N``: size flags, and the mesh table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autopart.errors import PlanError
from autopart.schema import DP_SHARDS
from autopart.solve.mesh import MeshResult

from ._format import gib

_NUM_SHOWN = 5
"""The chosen mesh and the next four."""


def parse_size(value: str | None, flag: str) -> int | str:
    """``auto`` or a positive integer; ``PlanError`` otherwise."""
    if value is None or value == "auto":
        return "auto"
    if not value.isdigit() or int(value) < 1:
        raise PlanError(f"{flag} must be auto or a positive integer, got {value!r}")
    return int(value)


def dp_shard(name: str | None, zero: int | None) -> tuple[int, bool]:
    """``(zero_stage, reshard_after_forward)`` of ``--dp-shard`` or ``--zero`` (one of them);
    ``PlanError`` when both are given and disagree."""
    by_zero = {0: "none", 1: "optimizer", 3: "params-per-step"}
    if name is not None and zero is not None and by_zero[zero] != name:
        raise PlanError(f"--zero {zero} means --dp-shard {by_zero[zero]}, not {name}; give "
                        f"one of them")
    return DP_SHARDS[name or by_zero[zero or 0]]


def print_mesh_table(result: MeshResult, console: Console) -> None:
    """The chosen mesh and the next four: schedule, level (the head's shards after a slash;
    tp above 1 plans whole layers, which the plan's notes say), predicted step, peak
    memory, why each lost."""
    shown = result.candidates[:_NUM_SHOWN]
    table = Table(title=f"mesh: {len(result.candidates)} tried, the chosen one and the next "
                        f"{len(shown) - 1}")
    for column in ("tp", "pp", "dp", "schedule", "level", "step ms", "dp traffic ms",
                   "TP comm ms", "peak memory", "why it lost"):
        table.add_column(column, justify="left" if column in ("schedule", "level",
                                                              "why it lost") else "right")
    for cand in shown:
        plan = cand.plan
        sched = (f"{plan.schedule} v={plan.virtual_stages} m={plan.num_microbatches}"
                 if plan else "")
        level = ""
        if plan is not None:
            level = plan.granularity + (f", head/{plan.head_shards}" if plan.head_shards
                                        else "")
        table.add_row(str(cand.tp_size), str(cand.pp_size), str(cand.dp_size), sched, level,
                      f"{cand.step_ms:.1f}" if cand.step_ms is not None else "",
                      f"{cand.grad_sync_ms:.1f}" if plan else "",
                      f"{cand.tp_comm_ms:.1f}" if plan else "",
                      gib(cand.peak_memory_bytes) if cand.peak_memory_bytes else "",
                      cand.lost_because or "[bold]chosen[/]")
    console.print(table)

"""One Chrome/Perfetto trace with the measured step next to the simulated one.

Process ``measured`` (pid 0) holds the median timed step of the run, one thread
per rank (compute spans and ``WAIT`` spans for send/receive waits); process
``simulated`` (pid 1) holds the simulator's step of the same plan, one thread per
rank, plus its transfers on process ``simulated sends`` (pid 2). Open it in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopart.jsonio import write_text
from autopart.simulate import SimEvent, SimResult
from autopart.verify.report import RunReport

__all__ = ["save_comparison_png", "write_comparison_trace"]

_PROCESSES = ((0, "measured"), (1, "simulated"), (2, "simulated sends"))


def comparison_trace(report: RunReport, sim: SimResult) -> dict[str, Any]:
    """Trace-event JSON (``ph "X"``, microseconds) of the measured and simulated steps."""
    events: list[dict[str, Any]] = []
    for pid, name in _PROCESSES:
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for rank in range(report.pp_size):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
    for rank, kind, stage, mb, start, end in report.measured_events:
        name = kind if kind in ("WAIT", "COUNT") else f"{kind}{mb} s{stage}"
        events.append(_span(name, 0, rank, start, end, "wait" if kind == "WAIT" else "compute"))
    for ev in sim.events:
        is_send = ev.kind == "SEND"
        events.append(_span(f"{'SEND ' if is_send else ''}{ev.kind if not is_send else ''}"
                            f"{ev.microbatch_idx} s{ev.stage_idx}", 2 if is_send else 1,
                            ev.rank, ev.start_ms, ev.end_ms, "send" if is_send else "compute"))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"predicted_step_ms": report.predicted_step_ms,
                          "measured_step_ms": report.measured_step_ms,
                          "plan_digest": report.plan_digest}}


def write_comparison_trace(report: RunReport, sim: SimResult, path: str | Path) -> None:
    """Write one Perfetto / chrome://tracing file of the measured and simulated steps.

    Args:
        report: The run report; its ``measured_events`` become process "measured".
        sim: The simulation of the same plan (``simulate_plan(plan)``), shown as
            processes "simulated" and "simulated sends".
        path: The JSON file to write.

    Raises:
        AutopartError: ``path`` cannot be written.
    """
    write_text(path, json.dumps(comparison_trace(report, sim)))


def _span(name: str, pid: int, tid: int, start_ms: float, end_ms: float,
          cat: str) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": start_ms * 1e3,
            "dur": max(0.0, end_ms - start_ms) * 1e3}


def save_comparison_png(report: RunReport, sim: SimResult, path: str | Path) -> Path:
    """The measured median step above the simulated one, one row per rank, as a PNG.

    Args:
        report: The run (its ``measured_events``).
        sim: The plan's simulated step (``simulate_plan``).
        path: The PNG to write.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        PlotError: matplotlib is not installed (one line with the install command).
    """
    from autopart.simulate.picture import save_timeline_png

    measured = [SimEvent(rank=rank, stage_idx=stage, microbatch_idx=mb, kind=kind,
                         start_ms=start, end_ms=end)
                for rank, kind, stage, mb, start, end in report.measured_events]
    return save_timeline_png(
        [(f"measured: {report.model}, {report.schedule}, m={report.num_microbatches}, step "
          f"{report.measured_step_ms:.1f} ms (median step)", measured),
         (f"predicted: step {report.predicted_step_ms:.1f} ms", sim.events)],
        path, num_ranks=report.pp_size)

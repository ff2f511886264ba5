"""Show a simulated step: Chrome/Perfetto trace JSON and a plain-text timeline.

Open a written trace in https://ui.perfetto.dev or chrome://tracing: one row per
rank (pid 0, tid = rank) with the compute actions, and one row per sending rank
(pid 1) with the transfers.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopart.jsonio import write_text
from autopart.simulate.engine import SimResult

__all__ = ["chrome_trace", "render_timeline", "write_trace"]

_COMPUTE_PID, _SEND_PID = 0, 1


def chrome_trace(result: SimResult, *, stage_names: Sequence[str] | None = None
                 ) -> dict[str, Any]:
    """Trace-event JSON of ``result``: ``ph "X"`` events, ``ts``/``dur`` in microseconds.

    Compute actions are named like ``F3 s1`` (kind, microbatch, stage) on pid 0,
    tid = rank; transfers like ``SEND F3 s1`` on pid 1, tid = sending rank.
    ``stage_names[s]``, when given, goes into each event's ``args``.
    """
    num_stages = len(result.stage_max_in_flight)
    if stage_names is not None and len(stage_names) != num_stages:
        raise ValueError(f"got {len(stage_names)} stage names, expected {num_stages}")
    events: list[dict[str, Any]] = []
    for pid, label in ((_COMPUTE_PID, "compute"), (_SEND_PID, "sends")):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": label}})
        for rank in range(len(result.rank_busy_ms)):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
    for ev in result.events:
        is_send = ev.kind == "SEND"
        args: dict[str, Any] = {"stage": ev.stage_idx, "microbatch": ev.microbatch_idx}
        if stage_names is not None:
            args["stage_name"] = stage_names[ev.stage_idx]
        events.append({
            "name": f"{ev.kind}{ev.microbatch_idx} s{ev.stage_idx}",
            "cat": "send" if is_send else "compute",
            "ph": "X",
            "pid": _SEND_PID if is_send else _COMPUTE_PID,
            "tid": ev.rank,
            "ts": ev.start_ms * 1e3,
            "dur": (ev.end_ms - ev.start_ms) * 1e3,
            "args": args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_ms": result.step_ms,
                          "bubble_fraction": result.bubble_fraction}}


def write_trace(result: SimResult, path: str | Path, **kw: Any) -> None:
    """Write ``chrome_trace(result, **kw)`` as JSON to ``path``."""
    write_text(path, json.dumps(chrome_trace(result, **kw)))


def render_timeline(result: SimResult, width: int = 100) -> str:
    """Plain-text timeline: one row per rank, ``F``/``B``/``W`` busy and ``.`` idle.

    Each character covers ``step_ms / width``; it shows the action running at the
    middle of that interval.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    num_ranks = len(result.rank_busy_ms)
    per_rank: list[list[tuple[float, float, str]]] = [[] for _ in range(num_ranks)]
    for ev in result.events:
        if ev.kind != "SEND":
            per_rank[ev.rank].append((ev.start_ms, ev.end_ms, ev.kind))
    cell = result.step_ms / width if result.step_ms > 0 else 0.0
    label = len(f"r{num_ranks - 1}")
    header = (f"step {result.step_ms:.3f} ms, bubble {result.bubble_fraction:.1%}, "
              f"one char = {cell:.3f} ms")
    lines = [header]
    for rank, spans in enumerate(per_rank):
        spans.sort()
        starts = [sp[0] for sp in spans]
        chars = []
        for col in range(width):
            t = (col + 0.5) * cell
            idx = bisect.bisect_right(starts, t) - 1
            busy = idx >= 0 and spans[idx][1] > t
            chars.append(spans[idx][2] if busy else ".")
        lines.append(f"{f'r{rank}':>{label}} |{''.join(chars)}|")
    return "\n".join(lines)

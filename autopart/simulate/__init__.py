"""Simulate a pipeline schedule with real durations: step time, bubbles, memory, traces.

``simulate_plan`` replays a ``Plan``; ``rank_orders`` gives each rank's compute
actions, ``simulate`` runs them as events, ``chrome_trace`` / ``render_timeline``
show the result.
"""

from autopart.simulate.chrome_trace import chrome_trace, render_timeline, write_trace
from autopart.simulate.engine import SimEvent, SimResult, simulate
from autopart.simulate.orders import Action, max_in_flight, rank_orders
from autopart.simulate.replay import simulate_plan, with_step_overhead

# Public entry points of the simulate phase.
__all__ = [
    "Action",
    "SimEvent",
    "SimResult",
    "chrome_trace",
    "max_in_flight",
    "rank_orders",
    "render_timeline",
    "simulate",
    "simulate_plan",
    "with_step_overhead",
    "write_trace",
]

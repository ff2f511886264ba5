"""Verify: run a plan for real, measure it against its prediction, calibrate the profile.

``verify_plan(plan, RunSettings(model=...))`` spawns the plan's ranks (or runs in
place under torchrun), trains a few steps on synthetic tokens, times every F/B/W
and p2p wait, measures per-rank peak memory and returns a ``RunReport``;
``verify_steadily`` pools two launches that agree (else the two fastest of three)
where one would do on a quiet machine, ``verify_in_turn`` several plans with their
launches taken in turn; ``calibrate_profile`` folds the measured stage
times back into the profile;
``write_comparison_trace`` puts the measured and simulated steps in one trace;
``check_machine`` measures the pipeline runtime's own cost once per machine;
``rehearse`` folds a short run of the model's even split into a CPU profile.
"""

from autopart.verify.calibrate import calibrate_profile
from autopart.verify.comparison import write_comparison_trace
from autopart.verify.machine import check_machine, load_cached_overhead, save_cached_overhead
from autopart.verify.rehearse import rehearse
from autopart.verify.report import RunReport
from autopart.verify.run import verify_in_turn, verify_plan, verify_steadily
from autopart.verify.worker import RunSettings

# Public entry points of the verify phase; everything else is internal.
__all__ = ["RunReport", "RunSettings", "calibrate_profile", "check_machine",
           "load_cached_overhead", "rehearse", "save_cached_overhead", "verify_in_turn",
           "verify_plan", "verify_steadily", "write_comparison_trace"]

"""The rehearsal: a CPU profile checked against short runs of the model's even split.

On a CPU machine that hosts the pipeline's ranks, blocks measured one at a time (beside
busy neighbours, again in model order) still run 5-15% faster than inside a two-rank
pipeline's stages, and a real run's sends and receives cost more than the machine
check's stages that compute little; the cause of the first is not found
(``docs/timing-sweep.md``). ``rehearse`` therefore runs what a user would verify first:
the model's even split under 1F1B, ``2 x pp`` microbatches, a few steps on the ranks the
profile was taken for (``verify_plan``), and folds the run into the profile
(``calibrate_profile``): the model's glue and stand-ins scaled by how much slower the
stages ran them (``autopart.verify.outside``), every block of a stage by the stage's
measured / predicted F and B, and the price per post at which the run's step is
predicted. A second
run, the even split under Interleaved 1F1B (v 2), prices the posts of torch's action
runtime (every multi-stage schedule) the same way, as the first cannot: its posts cost
more, and the machine check's difference between the two kinds does not hold on a real
model. A third, the even split under GPipe at ``4 x pp`` microbatches (the planner's
default count), prices GPipe's posts (``RuntimeOverhead.gpipe_p2p_ms``): GPipe waits its
forward sends after every forward and its backward sends when the step ends, and its
posts cost several times 1F1B's; where even free posts predict above that run (GPipe's
blocks ran faster than 1F1B's prices on a tiny Cohere and Nemotron), the step cannot
price them and the run's own time outside its actions per post does
(``calibrate.measured_post_ms``). Each run is measured as ``verify_steadily`` does (two
launches pooled where they agree, else a third and the two fastest pooled): one launch on a
host's slow spell would otherwise set every plan's post price. The 1F1B split runs once
more last, and what is folded in is the two 1F1B runs' geometric mean
(``pooled_report``): on a shared host a slow spell lasts longer than a run's launches,
which read alike, while runs minutes apart do not, so one run's stage factors carry its
spell into every plan (``docs/timing-sweep.md``). Where the two runs' steps differ by
more than ``LAUNCH_SPREAD`` a third run decides, and the two fastest are pooled: a
shared host's load only ever slows a run, so of three runs the slowest is the one a slow
spell took, even where two runs shared the spell (``_fastest_two``). The Interleaved
split runs again after the second 1F1B run and is pooled the same way, since its post
price is every multi-stage schedule's: in r32 its one run read the heavy-head Llama's
even split 9.7% above the sweep's runs of it, and every Interleaved plan of that model
carried the spell (the plan's +19.9%). GPipe's run, 1.7x longer and its price GPipe's
alone, runs once.
The Interleaved and GPipe runs' stages are not pooled: their F and B differ from 1F1B's
on small models (GPipe's eight microbatches in flight ran the tiny Qwen2's blocks 1.3x
slower), and their posts are priced with the blocks as pooled. ``autopart profile --pp
N`` does it on CPU; ``--no-rehearsal`` keeps the blocks as measured.
"""

from __future__ import annotations

import dataclasses

from autopart.profile.noise import agree
from autopart.schema import Profile
from autopart.verify.calibrate import calibrate_profile, fit_post_price, measured_post_ms
from autopart.verify.report import RunReport, pooled_report
from autopart.verify.run import LAUNCH_SPREAD, ProgressFn, fastest_two, verify_steadily
from autopart.verify.worker import RunSettings

__all__ = ["REHEARSAL_STEPS", "Rehearsal", "rehearse"]

REHEARSAL_STEPS = 5
"""Timed steps of the rehearsal (after ``REHEARSAL_WARMUP``): the median is kept."""
REHEARSAL_WARMUP = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Rehearsal:
    """The profile with the run folded in (its ``calibration`` records the run's
    predicted and measured step), and a line saying what the run showed."""

    profile: Profile
    summary: str
    """One line: the run, its step against the prediction, the factors folded in."""


def rehearse(profile: Profile, source: str, pp_size: int, *, steps: int = REHEARSAL_STEPS,
             warmup: int = REHEARSAL_WARMUP, progress: ProgressFn | None = None) -> Rehearsal:
    """Run the even split of ``profile``'s model on ``pp_size`` local ranks and fold the
    run into the profile (module docstring).

    Args:
        profile: A CPU profile of ``source`` (its threads are each rank's).
        source: The model, as ``autopart profile`` took it (preset, HF config path, ...).
        pp_size: Ranks this machine will host (``autopart profile --pp``).
        steps: Timed steps.
        warmup: Untimed steps first.
        progress: ``progress(done, total, what)``, as ``verify_plan`` reports it.

    Returns:
        The ``Rehearsal``; its profile's ``time_source`` ends with what was folded in and
        its ``calibration`` records the run.

    Raises:
        AutopartError: One line, where the even split cannot be planned (more ranks than
            blocks, memory) or the run fails.
    """
    from autopart.errors import AutopartError
    from autopart.solve import make_plan, plan_again

    plan = make_plan(profile, pp_size=pp_size, num_microbatches=2 * pp_size,
                     schedule="1f1b", virtual_stages=1, partition="even")
    settings = RunSettings(model=source, steps=steps, warmup=warmup,
                           threads_per_rank=max(1, profile.setup.num_threads))
    first, launches = verify_steadily(plan, settings, progress=progress)
    kinds = []  # (record key, name, plan, its runs (run, launches), or the refusal)
    for key, name, schedule, v, m in (
            ("runtime_post", "interleaved 1F1B (v 2)", "interleaved-1f1b", 2, 2 * pp_size),
            ("gpipe_post", f"GPipe (m {4 * pp_size})", "gpipe", 1, 4 * pp_size)):
        if profile.runtime_overhead is None:  # no machine check: no posts to price
            break
        try:
            kind = make_plan(profile, pp_size=pp_size, num_microbatches=m,
                             schedule=schedule, virtual_stages=v, partition="even")
            kinds.append((key, name, kind, [verify_steadily(kind, settings, progress=progress)]))
        except AutopartError as exc:
            kinds.append((key, name, None, exc))
    runs = [(first, launches), verify_steadily(plan, settings, progress=progress)]
    # the Interleaved run again, minutes after its first: its price is every
    # multi-stage schedule's (module docstring)
    again = [kind for kind in kinds if kind[0] == "runtime_post" and kind[2] is not None]
    for _, _, kind, kind_runs in again:
        kind_runs.append(verify_steadily(kind, settings, progress=progress))
    if not agree(*(run.measured_step_ms for run, _ in runs), LAUNCH_SPREAD):
        runs.append(verify_steadily(plan, settings, progress=progress))
    for _, _, kind, kind_runs in again:
        if not agree(*(run.measured_step_ms for run, _ in kind_runs), LAUNCH_SPREAD):
            kind_runs.append(verify_steadily(kind, settings, progress=progress))
    pooled = _fastest_two(runs)
    report = pooled_report(tuple(run for run, _ in pooled))
    what = (f"even split, 1F1B, m {plan.num_microbatches}, {steps} step(s) on {pp_size} "
            f"local ranks, {_times(runs)}")
    calibrated = calibrate_profile(profile, report, plan, source=f"rehearsal: {what}")
    record = dict(calibrated.calibration, launches_ms=_rounded(launches),
                  again_launches_ms=_rounded(runs[1][1]))
    if len(runs) == 3:
        record["third_launches_ms"] = _rounded(runs[2][1])
    factors = ", ".join(f"stage {f['stage']} F x{f['fwd']:.2f} B x{f['bwd_input']:.2f}"
                        for f in record["factors"])
    post = record.get("post")
    posts = (f", {post['before_ms']:.3f} -> {post['after_ms']:.3f} ms per send or receive"
             if post else "")
    latency = (f", link latency {post['link_latency_ms'][0]:.3f} -> "
               f"{post['link_latency_ms'][1]:.3f} ms" if post and "link_latency_ms" in post
               else "")
    count = record.get("count_pass")
    counted = (f", router loss counting pass priced {count['priced_ms']:.1f} ms, measured "
               f"{count['measured_ms']:.1f} ms (x{count['after']:.2f})" if count else "")
    priced = []
    for key, name, kind, kind_runs in kinds:
        if kind is None:
            priced.append(f"; {name} not rehearsed ({kind_runs})")
            continue
        # the same even cuts, predicted from the rehearsed blocks
        kind = plan_again(calibrated, kind)
        run = pooled_report(tuple(run for run, _ in _fastest_two(kind_runs)))
        outside = (measured_post_ms(run, calibrated.runtime_overhead)
                   if key == "gpipe_post" else None)
        overhead, fitted = fit_post_price(kind, run.measured_step_ms,
                                          calibrated.runtime_overhead, others=False,
                                          outside_ms=outside)
        record[key] = dict(fitted, **{field: _rounded(kind_launches) for field, (_, kind_launches)
                                      in zip(_LAUNCH_FIELDS, kind_runs)})
        calibrated = dataclasses.replace(calibrated, runtime_overhead=overhead)
        why = (" (its ranks' time outside actions: free posts predict above its step)"
               if fitted.get("from_outside") else "")
        measured = ", then ".join(f"{each.measured_step_ms:.1f} ms{_of_launches(each_launches)}"
                                  for each, each_launches in kind_runs)
        pooling = "" if len(kind_runs) == 1 else f" ({_times(kind_runs)}, {_which(kind_runs)})"
        priced.append(f"; {name} measured {measured}{pooling}: {fitted['before_ms']:.3f} -> "
                      f"{fitted['after_ms']:.3f} ms per post{why}")
    setup = dataclasses.replace(calibrated.setup, time_source=(
        f"{calibrated.setup.time_source}; then rehearsed ({what}): blocks scaled by their "
        f"stage's measured / predicted F and B, posts priced by the run's step"))
    measured = ", then ".join(f"{run.measured_step_ms:.1f} ms{_of_launches(run_launches)}"
                              for run, run_launches in runs)
    summary = (f"rehearsal ({what}): predicted {report.predicted_step_ms:.1f} ms, measured "
               f"{measured}; folded in ({_which(runs)}): {factors}{counted}{posts}{latency}"
               f"{''.join(priced)}")
    return Rehearsal(profile=dataclasses.replace(calibrated, setup=setup, calibration=record),
                     summary=summary)


def _fastest_two(runs: list[tuple[RunReport, tuple[float, ...]]]
                 ) -> list[tuple[RunReport, tuple[float, ...]]]:
    """The two runs (of two or three) with the shortest steps, in the order they ran
    (``fastest_two``). Until r22 of the timing sweep the two closest by ratio were kept,
    which kept a slow spell wherever it took two of the three runs: the heavy-head Llama's
    runs of 688.7, 609.9 and 664.3 ms pooled the slower two, and every plan read 9-17%
    over its run (r21, ``docs/timing-sweep.md``)."""
    return fastest_two(runs, lambda run: run[0].measured_step_ms)


_LAUNCH_FIELDS = ("launches_ms", "again_launches_ms", "third_launches_ms")
"""A kind's record: each of its runs' launches, in the order they ran."""


def _times(runs: list) -> str:
    """``twice`` or ``three times``: how often a split ran."""
    return "twice" if len(runs) == 2 else "three times"


def _which(runs: list) -> str:
    """What of a split's runs was folded in (``_fastest_two``)."""
    return "their geometric mean" if len(runs) == 2 else "the two fastest, their geometric mean"


def _rounded(launches: tuple[float, ...]) -> list[float]:
    return [round(step, 3) for step in launches]


def _of_launches(launches: tuple[float, ...]) -> str:
    """`` (two fastest of 3 launches: a, b, c ms)`` where a third launch ran, else ``""``."""
    if len(launches) < 3:
        return ""
    return f" (two fastest of 3 launches: {', '.join(f'{s:.1f}' for s in launches)} ms)"

"""Validation sweep of CPU step-time predictions on models nobody tuned them on (issue 22).

For each of a dozen generated shapes (three families, Llama, Qwen2 and the Mixtral MoE,
from tiny configs written here: hidden 64 to 1024, 2 to 24 layers, vocabulary 512 to
32k, several micro-batch and sequence sizes) it does what the README tells a user:

1. ``autopart profile CONFIG --pp 2`` (one thread, one busy neighbour), with this
   machine's runtime check attached (``autopart calibrate --machine --pp 2``, cached)
   and the rehearsal folded in (``autopart.verify.rehearse``: the even split's run);
2. ``autopart plan`` for pp 2 under 1F1B (v 1) and Interleaved 1F1B (v 2), each as the
   plan (``optimal``) and as the even split;
3. ``autopart verify`` each plan on 2 gloo ranks (``verify_plan``, the same code), in two
   launches, pooled where their steps agree within 10%, else a third and the two fastest
   pooled (as the rehearsal measures; through r23 the median kept), the plan's and the even
   split's launches taken in turn (``verify_in_turn``; since r19, before it one plan's
   launches, then the other's);
   ``--one-launch``: one launch each, as the sweeps before r9 did.

It prints, and writes as markdown (``--out``), every run's predicted and measured step,
and the distribution (median, 90th percentile, worst) of the step error, the per-stage
F and B errors, the speed-up error (even / plan, predicted against measured) and the
per-rank memory error, with the 1-minute load average before and after.

``--methods`` compares profiling methods on the same runs: the plans come from the first
method; each other method profiles the model again and predicts the same plans (same
cuts, schedule, v and m) from its own profile, so every method is judged against the
same measurements. A method is ``FLUSH:NEIGHBOURS[:CLOCK][:bare]``
(``ProfileOptions.cache_flush``, ``neighbours`` and ``clock``, ``auto`` when left out;
``bare``: no rehearsal, ``--no-rehearsal``), e.g. ``order:1,order:1:auto:bare``.

``--loop`` closes the loop on each shape as a user does: the 1F1B plan is verified
afresh, that run is folded into the profile (``calibrate_profile``), a new plan is made
from it and run at once, and its step error is reported.

    python scripts/timing_sweep.py --quick                  # 3 shapes, a few minutes
    python scripts/timing_sweep.py --out docs/timing-sweep.md
    python scripts/timing_sweep.py --quick --methods llc:1,none:1,none:0,llc:0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autopart.cost.stage import stage_post_ms
from autopart.errors import PlanError
from autopart.profile import profile_model
from autopart.profile.backends import AUTO_FLUSH, CACHE_FLUSHES
from autopart.schema import Plan, Profile
from autopart.solve import make_plan, plan_again
from autopart.verify import (
    RunReport,
    RunSettings,
    calibrate_profile,
    check_machine,
    load_cached_overhead,
    rehearse,
    save_cached_overhead,
    verify_in_turn,
    verify_plan,
)


@dataclass(frozen=True)
class Shape:
    """One generated model and its microbatch."""

    family: str
    hidden: int
    layers: int
    vocab: int
    mbs: int
    seq: int

    @property
    def name(self) -> str:
        """A short label, e.g. ``qwen2-h64-l6-v512-2x128``."""
        return (f"{self.family}-h{self.hidden}-l{self.layers}-v{self.vocab}-"
                f"{self.mbs}x{self.seq}")

    def config(self) -> dict[str, object]:
        """Keyword arguments of ``AutoConfig.for_model`` (dropout and jitter zero)."""
        heads = max(2, self.hidden // 64)
        cfg: dict[str, object] = {
            "hidden_size": self.hidden, "intermediate_size": _round8(self.hidden * 8 // 3),
            "num_hidden_layers": self.layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "vocab_size": self.vocab,
            "max_position_embeddings": max(256, self.seq), "attention_dropout": 0.0}
        if self.family == "mixtral":
            cfg.update(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                       intermediate_size=_round8(self.hidden * 2))
        return cfg


SHAPES = (
    Shape("qwen2", 64, 6, 512, 2, 128),       # the held-out tiny Qwen2
    Shape("llama", 256, 8, 32768, 1, 128),    # heavy-head Llama (vocab 32k, hidden 256)
    Shape("mixtral", 64, 4, 1024, 2, 64),     # MoE, 4 experts top-2
    Shape("llama", 128, 8, 8192, 2, 64),      # millisecond blocks
    Shape("llama", 512, 4, 4096, 1, 64),
    Shape("qwen2", 1024, 2, 16384, 1, 32),
    Shape("mixtral", 128, 6, 2048, 1, 128),
    Shape("llama", 64, 24, 512, 4, 32),
    Shape("qwen2", 256, 12, 8192, 2, 32),
    Shape("llama", 768, 3, 32000, 1, 32),
    Shape("mixtral", 256, 2, 4096, 2, 32),
    Shape("qwen2", 128, 16, 2048, 1, 256),
)
QUICK = (0, 1, 2)
"""``--quick``: the tiny Qwen2, the heavy-head Llama and the MoE."""
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2))


@dataclass
class Run:
    """One plan run for real, and each method's prediction of it."""

    shape: str
    schedule: str
    partition: str
    report: RunReport
    predicted: dict[str, Plan] = field(default_factory=dict)
    """Method -> the plan with the same cuts predicted from that method's profile."""
    probe_ms: float = 0.0
    """Median of the machine probe taken just before the run (``machine_probe``)."""
    launches: tuple[float, ...] = ()
    """Every launch's measured step, in launch order (``report`` pools the two fastest)."""


def _round8(n: int) -> int:
    return max(8, (n + 7) // 8 * 8)


def parse_methods(text: str) -> list[tuple[str, int, str, bool]]:
    """``"llc:1,none:0:thread:bare"`` -> ``[("llc", 1, "auto", True), ("none", 0,
    "thread", False)]``: no clock is ``auto``, the profile's default; ``bare`` skips the
    rehearsal (``--no-rehearsal``); exits 2 on a bad entry."""
    methods = []
    for item in text.split(","):
        flush, count, *rest = item.strip().split(":")
        bare = rest[-1:] == ["bare"]
        clock = rest[:-1] if bare else rest
        if (flush not in CACHE_FLUSHES or not count.isdigit() or len(clock) > 1
                or (clock and clock[0] not in ("auto", "wall", "thread"))):
            print(f"error: bad method {item!r}; expected FLUSH:NEIGHBOURS[:CLOCK][:bare] with "
                  f"FLUSH one of {', '.join(CACHE_FLUSHES)}, CLOCK auto, wall or thread, "
                  f"e.g. order:1 or order:1:auto:bare", file=sys.stderr)
            sys.exit(2)
        methods.append((flush, int(count), clock[0] if clock else "auto", not bare))
    return methods


def method_name(method: tuple[str, int, str, bool]) -> str:
    """``("none", 1, "auto", False)`` -> ``"flush none, 1 neighbour(s), not rehearsed"``
    (the clock when not ``auto``)."""
    clock = "" if method[2] == "auto" else f", {method[2]} clock"
    rehearsed = "" if method[3] else ", not rehearsed"
    return f"flush {method[0]}, {method[1]} neighbour(s){clock}{rehearsed}"


def write_config(shape: Shape, folder: Path) -> str:
    """Write ``shape``'s config.json under ``folder``; return its path (the model source)."""
    from transformers import AutoConfig

    path = folder / shape.name
    AutoConfig.for_model(shape.family, **shape.config()).save_pretrained(path)
    return str(path / "config.json")


def take_profile(source: str, shape: Shape, method: tuple[str, int, str, bool],
                 threads: int) -> Profile:
    """``autopart profile SOURCE --pp 2`` with this method's flush and neighbours, the
    cached machine check attached and, unless the method is ``bare``, the rehearsal
    folded in, as the CLI does."""
    torch.set_num_threads(threads)
    profile = profile_model(source, backend="cpu", seq_len=shape.seq,
                            micro_batch_size=shape.mbs, cache_flush=method[0],
                            neighbours=method[1], clock=method[2])
    check = load_cached_overhead("gloo", threads)
    if check is not None:
        profile = dataclasses.replace(profile, runtime_overhead=check)
    if method[3]:
        rehearsal = rehearse(profile, source, 2)
        print(f"  {rehearsal.summary}", flush=True)
        profile = rehearsal.profile
    return profile


def rel(pred: float, meas: float) -> float:
    """(pred - meas) / meas (0 when nothing was measured)."""
    return (pred - meas) / meas if meas else 0.0


def apart(values: list[float]) -> float:
    """How far measurements of one thing lie apart: highest over lowest, less 1."""
    return rel(max(values), min(values))


def run_errors(run: Run, method: str) -> dict[str, list[float]]:
    """The step, stage F, stage B and memory errors of one run under one method's plan."""
    plan, report = run.predicted[method], run.report
    out: dict[str, list[float]] = {
        "step": [rel(plan.predicted_step_ms, report.measured_step_ms)], "F": [], "B": [],
        "F cpu": [], "B cpu": [],
        "memory": [rel(r.predicted_peak_memory_bytes, r.measured_peak_memory_bytes)
                   for r in report.ranks]}
    last = len(plan.stages) - 1
    for stage, measured in zip(plan.stages, report.stages):
        # a measured span holds no posts: take the stage's off its F and B (through r35
        # they were left on, and a middle Interleaved stage read up to +826%)
        posts = stage_post_ms(plan.setup.runtime_overhead, stage.index > 0,
                              stage.index < last)
        fwd, bwd = stage.fwd_ms - posts, stage.bwd_ms - posts
        out["F"].append(rel(fwd, measured.measured_fwd_ms))
        out["B"].append(rel(bwd, measured.measured_bwd_ms))
        if measured.measured_fwd_cpu_ms:
            out["F cpu"].append(rel(fwd, measured.measured_fwd_cpu_ms))
        if measured.measured_bwd_cpu_ms:
            out["B cpu"].append(rel(bwd, measured.measured_bwd_cpu_ms))
    return out


def beyond_launches(run: Run, method: str) -> float | None:
    """How far ``method``'s predicted step lies outside the run's launches (the lowest to
    the highest launch's step), over the measured step: 0 inside them, ``None`` with one
    launch. What the prediction misses beyond the measurement's own spread."""
    if len(run.launches) < 2:
        return None
    predicted = run.predicted[method].predicted_step_ms
    low, high = min(run.launches), max(run.launches)
    outside = predicted - high if predicted > high else min(predicted - low, 0.0)
    return outside / run.report.measured_step_ms


def speedup_errors(runs: list[Run], method: str) -> list[tuple[str, str, float, float]]:
    """(shape, schedule, measured, predicted) speed-up of the plan over the even split."""
    by_key = {(r.shape, r.schedule, r.partition): r for r in runs}
    rows = []
    for (shape, schedule, partition), opt in by_key.items():
        even = by_key.get((shape, schedule, "even"))
        if partition != "optimal" or even is None or not (
                method in opt.predicted and method in even.predicted):
            continue
        measured = even.report.measured_step_ms / opt.report.measured_step_ms
        predicted = (even.predicted[method].predicted_step_ms
                     / opt.predicted[method].predicted_step_ms)
        rows.append((shape, schedule, measured, predicted))
    return rows


def distribution(values: list[float]) -> str:
    """``median / p90 / worst`` of the absolute values, in percent."""
    if not values:
        return "-"
    mags = sorted(abs(v) for v in values)
    p90 = mags[min(len(mags) - 1, int(round(0.9 * (len(mags) - 1))))]
    return (f"{100 * statistics.median(mags):.1f}% / {100 * p90:.1f}% / "
            f"{100 * mags[-1]:.1f}%")


QUIET = 0.15
"""A run is *quiet* when the machine probe before it read within 15% of the sweep's
quietest timing: the host was not running the sweep's ranks slower than at its best."""


SUMMARY_HEADER = ["method", "runs", "step", "step beyond launches", "stage F", "stage B",
                  "stage F vs CPU time", "stage B vs CPU time", "speed-up", "memory"]
"""The columns of ``summary_rows``."""


def summary_rows(runs: list[Run], methods: list[str],
                 quiet_ms: float | None = None) -> list[list[str]]:
    """One row per method: the distributions of each error over every run; with
    ``quiet_ms`` (the sweep's quietest probe timing) the first method again over the
    quiet runs only (``QUIET``), the speed-up where both of its runs were quiet."""
    rows = []
    quiet = [r for r in runs if quiet_ms and r.probe_ms <= (1 + QUIET) * quiet_ms]
    subsets = [(m, m, runs) for m in methods]
    if quiet_ms and methods:
        subsets.append((methods[0], f"{methods[0]}, quiet runs only", quiet))
    for method, label, subset in subsets:
        pooled: dict[str, list[float]] = {"step": [], "F": [], "B": [], "F cpu": [],
                                          "B cpu": [], "memory": []}
        beyond = []
        for run in subset:
            if method in run.predicted:
                for key, values in run_errors(run, method).items():
                    pooled[key] += values
                if (outside := beyond_launches(run, method)) is not None:
                    beyond.append(outside)
        speed = [rel(p, m) for _, _, m, p in speedup_errors(subset, method)]
        inside = sum(outside == 0 for outside in beyond)
        rows.append([label, str(len(pooled["step"])), distribution(pooled["step"]),
                     f"{distribution(beyond)} ({inside} inside)" if beyond else "-",
                     distribution(pooled["F"]), distribution(pooled["B"]),
                     distribution(pooled["F cpu"]), distribution(pooled["B cpu"]),
                     distribution(speed), distribution(pooled["memory"])])
    return rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def run_rows(runs: list[Run], method: str, quiet_ms: float) -> list[list[str]]:
    """Every run under ``method``: predicted, measured, step error, worst stage errors,
    and the probe before it against the sweep's quietest probe timing ``quiet_ms``."""
    rows = []
    for run in runs:
        if method not in run.predicted:
            continue
        errors = run_errors(run, method)
        plan = run.predicted[method]
        rows.append([run.shape, run.schedule, run.partition,
                     f"{plan.predicted_step_ms:.1f}", f"{run.report.measured_step_ms:.1f}",
                     f"{100 * errors['step'][0]:+.1f}%",
                     f"{100 * run.report.measured_step_ms_spread:.1f}%",
                     " ".join(f"{100 * e:+.0f}%" for e in errors["F"]),
                     " ".join(f"{100 * e:+.0f}%" for e in errors["B"]),
                     " ".join(f"{100 * e:+.1f}%" for e in errors["memory"]),
                     f"{cpu_share(run.report):.2f}",
                     f"{100 * (run.probe_ms / quiet_ms - 1):+.0f}%",
                     " ".join(f"{step:.1f}" for step in run.launches)])
    return rows


def cpu_share(report: RunReport) -> float:
    """The lowest rank's process CPU time over its compute time in a step: well under 1,
    the rank was descheduled (other work shared the cores) and its times are the load's."""
    return min((r.measured_cpu_ms / r.measured_busy_ms for r in report.ranks
                if r.measured_busy_ms), default=1.0)


def machine_probe(timings: int = 30) -> list[float]:
    """Time a fixed one-thread matmul ``timings`` times back to back (ms each): the
    machine's own noise while the sweep runs. The load average does not see a busy host
    under a virtual machine; this does (a quiet core times it within a few percent)."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(timings):
        began = time.perf_counter()
        for _ in range(10):
            a @ a
        times.append(1000 * (time.perf_counter() - began))
    return times


def launch_line(runs: list[Run]) -> str:
    """One sentence on the measurement's own reproducibility: how far each run's first two
    launches of one plan read apart (over the smaller), and how many needed a third. A
    prediction cannot be checked tighter than this."""
    pairs = [apart(r.launches[:2]) for r in runs if len(r.launches) >= 2]
    if not pairs:
        return ""
    third = sum(len(r.launches) >= 3 for r in runs)
    return (f"two launches of one plan read {distribution(pairs)} apart (median / p90 / "
            f"worst, over the smaller), a third launch in {third} of {len(runs)} runs")


def probe_line(probes: list[list[float]]) -> str:
    """One sentence on the probes: the quiet time (the lowest) and how far the median and
    the 90th percentile of all timings were above it."""
    every = sorted(t for p in probes for t in p)
    if not every:
        return ""
    quiet, median = every[0], statistics.median(every)
    p90 = every[int(0.9 * (len(every) - 1))]
    return (f"machine probe (a fixed one-thread matmul timed {len(every)} times, 30 "
            f"before each run): quietest {quiet:.2f} ms, median "
            f"{100 * (median / quiet - 1):+.0f}%, p90 {100 * (p90 / quiet - 1):+.0f}%, "
            f"worst {100 * (every[-1] / quiet - 1):+.0f}%")


def main() -> None:
    """Run the sweep (module docstring) and print / write its tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 shapes (tiny Qwen2, heavy "
                        "head, MoE) under 1F1B only")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    parser.add_argument("--methods", default=f"{AUTO_FLUSH['cpu']}:1",
                        help="FLUSH:NEIGHBOURS[:CLOCK],...; the first makes the plans "
                        "(default: what `autopart profile --pp 2` does: the cpu default "
                        "flush, one neighbour, the auto clock)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--one-launch", action="store_true", help="measure each run in one "
                        "launch (default: two, pooled where they agree within 10%%, else a "
                        "third and the two fastest pooled; the plan's and the even split's "
                        "in turn)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--loop", action="store_true", help="verify -> calibrate -> replan "
                        "-> verify the 1F1B plan of each shape")
    parser.add_argument("--out", default=None, help="write the tables as markdown here")
    parser.add_argument("--json", default=None, help="write every figure as JSON here")
    args = parser.parse_args()
    methods = parse_methods(args.methods)
    names = [method_name(m) for m in methods]
    indices = ([int(i) for i in args.shapes.split(",")] if args.shapes
               else list(QUICK) if args.quick else list(range(len(SHAPES))))
    schedules = SCHEDULES[:1] if args.quick else SCHEDULES
    threads = max(1, (os.cpu_count() or 1) // 2)
    start, load_before = time.perf_counter(), os.getloadavg()
    loads = [load_before[0]]
    if load_cached_overhead("gloo", threads) is None:
        save_cached_overhead(check_machine(num_threads=threads))
    settings_of = {}
    runs: list[Run] = []
    loop_rows: list[list[str]] = []
    probes: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="timing-sweep-") as tmp:
        for index in indices:
            shape = SHAPES[index]
            source = write_config(shape, Path(tmp))
            settings_of[shape.name] = RunSettings(model=source, steps=args.steps,
                                                  warmup=args.warmup, threads_per_rank=threads)
            profiles = {}
            for name, method in zip(names, methods):
                began = time.perf_counter()
                profiles[name] = take_profile(source, shape, method, threads)
                print(f"{shape.name:>34} profiled with {name} in "
                      f"{time.perf_counter() - began:.0f} s, load {os.getloadavg()[0]:.2f}",
                      flush=True)
            for schedule, v in schedules:
                plans = {partition: make_plan(profiles[names[0]], pp_size=2,
                                              num_microbatches=args.microbatches,
                                              schedule=schedule, virtual_stages=v,
                                              partition=partition)
                         for partition in ("optimal", "even")}
                probes.append(machine_probe())
                measured = measure(list(plans.values()), settings_of[shape.name], args)
                for (partition, plan), (report, launches) in zip(plans.items(), measured):
                    run = Run(shape.name, schedule, partition, report, {names[0]: plan},
                              statistics.median(probes[-1]), launches)
                    for name in names[1:]:
                        try:
                            run.predicted[name] = plan_again(profiles[name], plan)
                        except PlanError as exc:  # e.g. slices of two K: --cuts refuses them
                            print(f"  {name}: cannot predict the same cuts ({exc})", flush=True)
                    runs.append(run)
                    loads.append(os.getloadavg()[0])
                    print(f"{shape.name:>34} {schedule:>16} {partition:>7}: predicted "
                          f"{plan.predicted_step_ms:8.1f} ms, measured "
                          f"{report.measured_step_ms:8.1f} ms "
                          f"({100 * report.step_error:+.1f}%), cpu/busy {cpu_share(report):.2f}, "
                          f"load {loads[-1]:.2f}",
                          flush=True)
            if args.loop:
                loop_rows.append(close_loop(shape, profiles[names[0]], runs, args,
                                            settings_of[shape.name]))
                print("  loop: " + " ".join(loop_rows[-1][1:]), flush=True)
            write_outputs(args, indices, schedules, threads, names, runs, loop_rows, loads,
                          probes, load_before, start, final=False)
    write_outputs(args, indices, schedules, threads, names, runs, loop_rows, loads, probes,
                  load_before, start, final=True)


def write_outputs(args: argparse.Namespace, indices: list[int], schedules: tuple,
                  threads: int, names: list[str], runs: list[Run],
                  loop_rows: list[list[str]], loads: list[float], probes: list[list[float]],
                  load_before: tuple[float, ...], start: float, final: bool) -> None:
    """Write the markdown (``--out``) and JSON (``--json``) of the runs so far (after each
    shape, so a sweep cut short keeps what it measured); print them when ``final``."""
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - start
    quiet = min((t for p in probes for t in p), default=1.0)
    summary = summary_rows(runs, names, quiet)
    command = "python scripts/timing_sweep.py " + " ".join(sys.argv[1:])
    launches = launch_line(runs)
    text = [f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{len(indices)} shapes x {len(schedules)} schedule(s) x (plan, even), 2 gloo "
            f"ranks x {threads} thread(s), m={args.microbatches}, {args.steps} timed steps, "
            f"{'one launch' if args.one_launch else 'two launches (or the fastest two of three)'}"
            f", the plan's and the even split's in turn; "
            f"1-minute load average before {load_before[0]:.2f}, after {load_after[0]:.2f}, "
            f"median over runs {statistics.median(loads):.2f}, max {max(loads):.2f} "
            f"({os.cpu_count()} cores); {probe_line(probes)}"
            f"{'; ' + launches if launches else ''}; {elapsed:.0f} s"
            f"{'' if final else f'; cut short after {len(runs)} runs'}.",
            "",
            "|error| median / p90 / worst (prediction - measured) / measured; \"beyond "
            "launches\": how far the prediction lies outside the run's launches (lowest to "
            "highest step), over the measured step, 0 inside them; \"vs CPU "
            "time\": against the stage's thread CPU time, which a rank descheduled by other "
            "load does not accrue; cpu/busy: the lowest rank's CPU time over its compute "
            "spans (1: never descheduled); probe: the machine probe's median just before "
            "the run against its quietest timing in the sweep; quiet runs: probe within "
            f"{100 * QUIET:.0f}% of it:", "",
            markdown_table(SUMMARY_HEADER, summary)]
    for name in names:
        text += ["", f"Runs, predicted from the profile taken with {name}:", "",
                 markdown_table(["shape", "schedule", "split", "pred ms", "meas ms", "step err",
                                 "spread", "stage F err", "stage B err", "memory err", "cpu/busy",
                                 "probe", "launches ms"],
                                run_rows(runs, name, quiet))]
        speed = speedup_errors(runs, name)
        text += ["", markdown_table(
            ["shape", "schedule", "speed-up measured", "predicted", "error"],
            [[s, sch, f"{m:.3f}x", f"{p:.3f}x", f"{100 * rel(p, m):+.1f}%"]
             for s, sch, m, p in speed])]
    if loop_rows:
        text += ["", "Verify -> calibrate -> replan -> verify (1F1B; the plan verified afresh "
                 f"just before calibrating): {loop_line(loop_rows)}:", "",
                 markdown_table(LOOP_HEADER, loop_rows)]
    if final:
        print("\n".join(text))
    if args.out:
        Path(args.out).write_text("\n".join(text) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": command, "load_before": load_before, "load_after": load_after,
             "loads": loads, "probes": probes, "summary": summary,
             "runs": [{"shape": r.shape, "schedule": r.schedule, "partition": r.partition,
                       "measured_step_ms": r.report.measured_step_ms,
                       "launches_ms": list(r.launches),
                       "cuts": list(r.predicted[names[0]].pipeline_cuts),
                       "granularity": r.predicted[names[0]].granularity,
                       "measured_memory_bytes": [k.measured_peak_memory_bytes
                                                 for k in r.report.ranks],
                       "cpu_share": cpu_share(r.report), "probe_ms": r.probe_ms,
                       "errors": {n: run_errors(r, n) for n in r.predicted}} for r in runs],
             "loop": loop_rows}, indent=1))



def measure(plans: list[Plan], settings: RunSettings, args: argparse.Namespace
            ) -> list[tuple[RunReport, tuple[float, ...]]]:
    """Each plan's run and every launch's step: ``verify_in_turn`` (the plan and the even
    split launched alternately, so a slow spell of the host falls on both and their ratio,
    the speed-up, does not carry it), or one launch each in turn with ``--one-launch``."""
    if args.one_launch:
        reports = [verify_plan(plan, settings) for plan in plans]
        return [(report, (report.measured_step_ms,)) for report in reports]
    return verify_in_turn(plans, settings)


def close_loop(shape: Shape, profile: Profile, runs: list[Run], args: argparse.Namespace,
               settings: RunSettings) -> list[str]:
    """Close the loop on the shape's 1F1B plan as a user does: verify the plan, calibrate
    ``profile`` with that run, plan again and verify the new plan at once. The plan is
    verified afresh rather than its sweep run reused, which the interleaved runs followed:
    a slow spell lasts minutes, and the new plan is judged against a calibration taken
    just before it. Returns the row: shape, the sweep run's error, the fresh run's error,
    the replanned prediction, measurement and error, the replanned cuts (``same`` as the
    first plan's: then the two runs differ by the host alone), both runs' launches and the
    machine probe before each."""
    first = next(r for r in runs if r.shape == shape.name and r.schedule == "1f1b"
                 and r.partition == "optimal")
    plan = first.predicted[next(iter(first.predicted))]
    probe_first = statistics.median(machine_probe())
    [(verified, first_launches)] = measure([plan], settings, args)
    calibrated = calibrate_profile(profile, verified, plan)
    again = make_plan(calibrated, pp_size=2, num_microbatches=args.microbatches,
                      schedule="1f1b", virtual_stages=1)
    probe = statistics.median(machine_probe())
    [(report, launches)] = measure([again], settings, args)
    same = list(again.pipeline_cuts) == list(plan.pipeline_cuts)
    return [shape.name, f"{100 * first.report.step_error:+.1f}%",
            f"{100 * verified.step_error:+.1f}%",
            f"{again.predicted_step_ms:.1f}", f"{report.measured_step_ms:.1f}",
            f"{100 * report.step_error:+.1f}%",
            "same" if same else ", ".join(again.pipeline_cuts),
            " ".join(f"{ms:.1f}" for ms in first_launches),
            " ".join(f"{ms:.1f}" for ms in launches),
            f"{probe_first:.2f} / {probe:.2f}"]


LOOP_HEADER = ["shape", "sweep run err", "verified err", "replanned pred ms", "meas ms", "err",
               "replanned cuts", "verified launches ms", "replanned launches ms",
               "probe ms verified / replanned"]


def loop_line(loop_rows: list[list[str]]) -> str:
    """The replanned runs' |step error| median / p90 / worst and how many are within 5%
    and within 10%, from the loop table's rows."""
    errors = [abs(float(row[LOOP_HEADER.index("err")].rstrip("%"))) / 100 for row in loop_rows]
    return (f"replanned |step error| {distribution(errors)} (median / p90 / worst), within "
            f"5% on {sum(e <= 0.05 for e in errors)} of {len(errors)}, within 10% on "
            f"{sum(e <= 0.10 for e in errors)}")


if __name__ == "__main__":
    main()

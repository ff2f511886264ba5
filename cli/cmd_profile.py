"""``autopart profile MODEL``: measure (or estimate) every block and write the profile JSON.

Example: ``autopart profile tiny-llama --seq-len 256`` writes
``./tiny-llama.cpu.profile.json`` and shows a per-block table; ``--backend
analytical:h100`` estimates on meta from ``profiles/devices.json`` instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from autopart.errors import AutopartError, ProfileError
from autopart.intake.blocks import DISCOVERY_LEVELS
from autopart.jsonio import check_writable
from autopart.profile import ProfileOptions, list_devices, profile_model
from autopart.schema import Profile
from autopart.schema.parts import LEVEL_ALIASES
from autopart.verify.machine import machine_check_for
from autopart.verify.rehearse import rehearse

from ._progress import progress_bar

_MIB = 1024 * 1024


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``profile`` command."""
    p = subparsers.add_parser(
        "profile", help="measure each block's latency and memory",
        description="Profile every block of MODEL (preset, HF config path or directory, "
                    "cached hub id, or package.module:factory) for one microbatch of training.")
    p.add_argument("model", metavar="MODEL", help="e.g. tiny-llama, ./config.json, pkg.mod:fn")
    p.add_argument("--backend", default="cpu",
                   help=f"cpu | cuda | xla | analytical:<device> "
                        f"(devices: {', '.join(list_devices())}); default cpu")
    p.add_argument("--micro-batch-size", type=int, default=1, metavar="N")
    p.add_argument("--seq-len", type=int, default=128, metavar="N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--repeats", type=int, default=10, metavar="N", help="timed repeats per block")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="warm-up runs per block")
    p.add_argument("--layer-class", action="append", default=None, metavar="NAME",
                   help="class name of the repeated layers (repeatable); overrides discovery")
    p.add_argument("--granularity", default="projection",
                   choices=[*reversed(DISCOVERY_LEVELS), *LEVEL_ALIASES],
                   metavar="{projection,half,layer}",
                   help="the finest level to measure: projection (default: each decoder "
                        "layer's attention and MLP halves, each cut before its output "
                        "projection, wherever a cut there is exact; the profile says where "
                        "it is not), half (the two halves only) or layer (whole layers). "
                        "Identical parts are measured once; plans may use any coarser level")
    p.add_argument("--out", type=Path, default=None, metavar="PATH",
                   help="profile JSON to write (default ./<model>.<backend>.profile.json)")
    p.add_argument("--json", action="store_true", help="print the profile JSON on stdout")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads while profiling; use what each rank will get when "
                        "training (e.g. cores / ranks), else times do not transfer")
    p.add_argument("--pp", type=int, default=None, metavar="N",
                   help="ranks this machine will host when training: on CPU, profile with "
                        "cores / N threads, what each rank gets (--threads wins), while N - 1 "
                        "neighbour processes profile the same model, as the other ranks will "
                        "load the CPU")
    p.add_argument("--cache-flush", default="auto",
                   choices=("auto", "none", "llc", "model", "order"),
                   help="before each timed call: auto (cpu: order, cuda: llc), model (cpu: "
                        "read the model's weights' worth, run the call on a copy of the "
                        "block's weights, touch its input), order (cpu: as model, then the "
                        "forwards timed again in model order), none (back to back), llc "
                        "(write over twice the last-level cache, the GPU's L2)")
    p.add_argument("--clock", default="auto", choices=("auto", "wall", "thread"),
                   help="wall (perf_counter); thread (cpu, one thread): the thread's CPU "
                        "time, which waiting for a core on a shared machine does not add "
                        "to; auto (default): thread on one-thread cpu profiles, else wall")
    p.add_argument("--no-rehearsal", action="store_true",
                   help="CPU with --pp N (N >= 2): keep the blocks as measured; by default "
                        "a few steps of the model's even split run on N local ranks and "
                        "every block is scaled by its stage's measured / predicted time "
                        "(autopart.verify.rehearse)")
    p.add_argument("--neighbours", type=int, default=None, metavar="K",
                   help="CPU: neighbour processes busy while measuring (default: N - 1 with "
                        "--pp N, else 0; 0 measures alone)")


def run(args: argparse.Namespace) -> int:
    """Profile, write the JSON, show the summary."""
    if args.threads is not None:
        if args.threads < 1:
            raise ProfileError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    elif args.pp is not None:
        if args.pp < 1:
            raise ProfileError(f"--pp must be >= 1, got {args.pp}")
        if args.backend == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.pp))
    options = profile_options(args)  # flags checked before profiling, as the output path
    if args.out is not None:
        check_writable(args.out)  # before profiling, not after
    with progress_bar("profiling") as progress:
        profile = profile_model(args.model, options, progress=progress)
    check = machine_check_for(profile)
    if check is not None:
        profile = dataclasses.replace(profile, runtime_overhead=check)
    rehearsal, checked, not_rehearsed = None, profile, ""
    if _rehearses(args):
        try:
            with progress_bar("rehearsing") as progress:
                rehearsal = rehearse(profile, args.model, args.pp, progress=progress)
            profile = rehearsal.profile
        except AutopartError as exc:  # the profile stands as measured, and says why
            not_rehearsed = (f"not rehearsed ({exc}); the blocks stay as measured "
                             f"(--no-rehearsal skips the rehearsal)")
    out = args.out or Path.cwd() / default_filename(profile)
    profile.save(out)
    if args.json:
        sys.stdout.write(profile.to_json())
    else:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
        console.print(summary_table(profile))
        for note in profile.model.notes:
            console.print(f"note: {note}", soft_wrap=True, highlight=False, markup=False)
        _print_machine_check(checked, console)
        if rehearsal is not None:
            console.print(rehearsal.summary, soft_wrap=True, highlight=False, markup=False)
        _print_noise(profile, console)
    if not_rehearsed:
        Console(stderr=True).print(f"note: {not_rehearsed}", soft_wrap=True, highlight=False,
                                   markup=False)
    Console(stderr=True).print(f"wrote {out}", soft_wrap=True, highlight=False)
    return 0


def _rehearses(args: argparse.Namespace) -> bool:
    """Whether to rehearse: ``--pp N`` (N >= 2) on CPU, unless ``--no-rehearsal``."""
    return args.backend == "cpu" and (args.pp or 1) >= 2 and not args.no_rehearsal


def profile_options(args: argparse.Namespace) -> ProfileOptions:
    """The command line's flags as ``ProfileOptions``."""
    return ProfileOptions(
        backend=args.backend, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
        dtype=args.dtype, num_warmup=args.warmup, num_repeats=args.repeats,
        layer_classes=tuple(args.layer_class) if args.layer_class else None,
        granularity=args.granularity, neighbours=_neighbours(args),
        cache_flush=args.cache_flush, clock=args.clock)


def _neighbours(args: argparse.Namespace) -> int:
    """Busy neighbours to measure with: ``--neighbours``, else ``--pp N`` - 1 on CPU."""
    if args.neighbours is not None:
        if args.neighbours < 0:
            raise ProfileError(f"--neighbours must be >= 0, got {args.neighbours}")
        if args.neighbours and args.backend != "cpu":
            raise ProfileError(f"--neighbours is for the cpu backend (ranks sharing one CPU), "
                               f"not {args.backend}; drop it")
        return args.neighbours
    return args.pp - 1 if args.pp is not None and args.backend == "cpu" else 0


def _print_noise(profile: Profile, console: Console) -> None:
    """One warning line when measurements were disturbed (spread, disagreement, load)."""
    noisy = [b for b in profile.blocks if b.noisy and not b.reused_from]
    load = max(profile.setup.load_average, default=0.0)
    # the neighbours' own load is expected: they stand in for the other ranks
    busy = load > max(os.cpu_count() or 1, profile.setup.neighbours + 1)
    if not noisy and not busy:
        return
    what = (f"{len(noisy)} block(s) stayed disturbed after re-measuring (spread up to "
            f"{100 * max(max(b.fwd_ms_spread, b.bwd_ms_spread) for b in noisy):.0f}%: "
            f"{', '.join(b.name for b in noisy[:3])}{' ...' if len(noisy) > 3 else ''})"
            if noisy else "the CPU was busy")
    console.print(f"warning: {what}; load average {load:.2f} on {os.cpu_count()} cores: "
                  f"times may be off, profile again on a quieter machine", soft_wrap=True,
                  highlight=False)


def _print_machine_check(profile: Profile, console: Console) -> None:
    """Say which machine check the plans will add, or how to run one."""
    s = profile.setup
    if s.backend not in ("cpu", "cuda"):
        return
    check = profile.runtime_overhead
    if check is None:
        console.print(f"note: no machine check for {s.num_threads} thread(s) here: plans leave "
                      f"out the pipeline runtime's own cost; run `autopart calibrate --machine "
                      f"--threads {s.num_threads}` once, then profile again", soft_wrap=True,
                      highlight=False)
        return
    console.print(f"runtime overhead (machine check of {check.measured_at}, {check.num_threads} "
                  f"thread(s)): F +{check.fwd_action_ms:.3f} ms, B +{check.bwd_action_ms:.3f} ms, "
                  f"send/recv +{check.p2p_ms:.3f} ms (multi-stage schedules "
                  f"+{check.runtime_p2p_ms:.3f} ms), step +{check.step_ms:.3f} ms",
                  soft_wrap=True, highlight=False)


def default_filename(profile: Profile) -> str:
    """``<model>.<backend>.profile.json`` with path-unsafe characters replaced."""
    def clean(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"

    return f"{clean(profile.model.name)}.{clean(profile.setup.backend)}.profile.json"


def summary_table(profile: Profile) -> Table:
    """One row per block and a total line."""
    s = profile.setup
    table = Table(title=f"{profile.model.name} on {s.backend} ({s.device_name}), {s.dtype}, "
                        f"mbs {s.micro_batch_size} x seq {s.seq_len}", show_footer=True,
                  caption=f"times {s.time_source}; memory {s.memory_source}",
                  caption_justify="left")
    blocks = profile.blocks
    total_params = sum(b.num_params for b in blocks)
    columns = [
        ("block", "total"), ("kind", ""),
        ("fwd ms", f"{sum(b.fwd_ms for b in blocks):.3f}"),
        ("B ms", f"{sum(b.bwd_input_ms for b in blocks):.3f}"),
        ("W ms", f"{sum(b.bwd_weight_ms for b in blocks):.3f}"),
        ("params", _count(total_params)),
        ("act MiB", f"{sum(b.activation_bytes for b in blocks) / _MIB:.2f}"),
        ("out MiB", ""), ("times", ""), ("reused from", ""),
    ]
    for i, (name, footer) in enumerate(columns):
        table.add_column(name, footer=footer, justify="right" if 2 <= i <= 7 else "left")
    for b in blocks:
        source = "measured" if "fwd_ms" in b.measured else "estimated"
        if b.noisy:
            source = "noisy"  # disturbed even after re-measuring (see the warning line)
        table.add_row(b.name, b.kind, f"{b.fwd_ms:.3f}", f"{b.bwd_input_ms:.3f}",
                      f"{b.bwd_weight_ms:.3f}", _count(b.num_params),
                      f"{b.activation_bytes / _MIB:.2f}", f"{b.output_bytes / _MIB:.2f}",
                      source, b.reused_from or "")
    return table


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)

"""Human-readable reasons in a plan (``notes``) and the message when nothing fits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopart.errors import InfeasibleError
from autopart.schedules import recompute_allowed, schedule_info, stage_to_rank
from autopart.schema import Profile
from autopart.simulate import max_in_flight
from autopart.solve.dp import min_fitting_limit
from autopart.solve.records import Candidate, Config, Evaluated, Options
from autopart.solve.setting import Setting

_GIB = float(1 << 30)
_MAX_CONFIGS_FOR_MESSAGE = 16


def _rank_of(ev: Evaluated, stage_idx: int) -> int:
    style = schedule_info(ev.schedule).style
    return stage_to_rank(stage_idx, ev.pp_size, ev.virtual_stages, style)


def _units_per_rank(profile: Profile, ev: Evaluated) -> tuple[list[int], str]:
    """Decoder layers (or blocks, for non-HF chains) each rank holds."""
    has_layers = any(b.kind == "decoder_layer" for b in profile.blocks)
    counts = [0] * ev.pp_size
    for s, (i, j) in enumerate(ev.bounds):
        blocks = profile.blocks[i:j]
        counts[_rank_of(ev, s)] += sum(1 for b in blocks
                                       if not has_layers or b.kind == "decoder_layer")
    return counts, "layers" if has_layers else "blocks"


def _rank_in_flight(ev: Evaluated) -> list[int]:
    in_flight = max_in_flight(ev.schedule, ev.pp_size, ev.virtual_stages, ev.num_microbatches)
    out = [0] * ev.pp_size
    for s, k in enumerate(in_flight):
        out[_rank_of(ev, s)] = max(out[_rank_of(ev, s)], k)
    return out


def _microbatches(count: int) -> str:
    return f"{count} microbatch" + ("" if count == 1 else "es")


def notes(profile: Profile, best: Evaluated, baselines: dict[str, Evaluated],
          memory_limit_bytes: int | None, *, default_m: bool, rescaled: bool) -> list[str]:
    """Why the plan looks the way it does, one sentence each."""
    out = []
    if default_m:
        out.append(f"num_microbatches defaulted to 4 * pp = {best.num_microbatches}; pass "
                   "--microbatches or --global-batch-size to choose")
    if rescaled:
        out.append(f"per-microbatch costs rescaled linearly from the profiled micro batch "
                   f"size {profile.setup.micro_batch_size} for m = {best.num_microbatches}")
    even = baselines.get("even")
    if memory_limit_bytes is not None and even is not None and not even.fits:
        plan_units, word = _units_per_rank(profile, best)
        even_units, _ = _units_per_rank(profile, even)
        held = _rank_in_flight(best)
        low = min(range(best.pp_size), key=lambda r: (held[r], -r))
        for rank, peak in enumerate(even.result.rank_peak_memory_bytes):
            if peak <= memory_limit_bytes or plan_units[rank] >= even_units[rank]:
                continue
            why = (f"rank {rank} holds {_microbatches(held[rank])} of activations under "
                   f"{best.schedule} (rank {low} holds {held[low]})" if held[rank] > held[low]
                   else f"rank {rank}'s blocks keep large activations")
            out.append(f"{why}: it gets {plan_units[rank]} {word}, not {even_units[rank]} "
                       f"(the even split needs {peak / _GIB:.2f} GiB there, over the "
                       f"{memory_limit_bytes / _GIB:.2f} GiB limit)")
    recomputed = [s for s, r in enumerate(best.recompute) if r]
    if recomputed:
        out.append(f"stages {recomputed} recompute their forward (activation checkpointing): "
                   "without it they do not fit the memory limit")
    if profile.model.router_loss_pass:
        whole = schedule_info(best.schedule).split_backward
        out.append("the MoE router loss the config asks for counts each step's routing in a "
                   + ("whole extra step first (a split-backward schedule cannot run "
                      "forward-only): in the predicted step" if whole else
                      "forward-only pass first: in the predicted step"))
    return out


def _size(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f} GiB" if num_bytes >= _GIB else f"{num_bytes / 2**20:.1f} MiB"


def infeasible(settings: Mapping[int, Setting], configs: Sequence[Config],
               found: Sequence[Candidate], options: Options) -> InfeasibleError:
    """The error to raise when no candidate fits: it names the memory that would fit."""
    need, where = None, ""
    pp_size = configs[0].pp_size
    limit = next(iter(settings.values())).setup.memory_limit_bytes
    partition = options.partition
    for config in list(configs)[:_MAX_CONFIGS_FOR_MESSAGE]:
        in_flight = max_in_flight(config.schedule, pp_size, config.virtual_stages,
                                  config.num_microbatches)
        value = min_fitting_limit(settings[config.num_microbatches].chain,
                                  in_flight=in_flight, num_virtual=config.virtual_stages,
                                  allow_recompute=recompute_allowed(config.schedule,
                                                                   options.allow_recompute),
                                  split=schedule_info(config.schedule).split_backward)
        if need is None or value < need:
            need, where = value, config.label.replace(" ", ", ")
    limit_text = "no limit" if limit is None else f"{limit} bytes ({_size(limit)})"
    message = f"no plan fits the per-device memory limit of {limit_text} with pp_size={pp_size}"
    peaks = [c.evaluated.peak_memory_bytes for c in found]
    if partition != "optimal" and peaks:
        message += f"; the {partition} split needs {min(peaks)} bytes ({_size(min(peaks))})"
    if partition != "optimal" and limit is not None and need <= limit:
        message += " while the optimal partition fits this limit: use --partition optimal"
    else:
        message += (f"; the smallest limit that fits is {need} bytes ({_size(need)}, {where}, "
                    f"optimal partition); raise the memory limit, raise --pp or lower the "
                    f"micro batch size")
    return InfeasibleError(message, needed_bytes=need)

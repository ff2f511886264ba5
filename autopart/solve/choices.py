"""Which levels and head cuts a plan tries, and the fastest of them (``auto`` granularity).

A profile holds its blocks at the finest level intake measured exactly; the coarser
levels' cuts are a subset of its cuts, and the search seeds itself with their splits
(``Setting.coarser``), so one search at the measured level covers them. What it does not
cover are the derived parts (``autopart.levels``): halves cut by units (``slice``) and the
head cut by vocabulary, each held whole by every rank with a part. ``auto`` therefore plans
up to four *choices*: the measured level or ``slice``, each with the head whole or in
vocabulary shards.

The first choice is searched over every (schedule, v, m); the others over the best
``_CONFIGS_CARRIED`` configurations it found (their orders are built once and cached).
The local search, most of a search's time, then runs on the finalists only: the fastest
choice with whole halves and the fastest with slices. Both are heuristics that keep
``auto`` within about one search's time, stated in the plan's notes. Slices are kept only
when they predict a step ``SLICE_MARGIN`` faster (their costs are the half's by unit
fraction, not measured), the head's shards when strictly faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopart.errors import PlanError
from autopart.levels import MAX_SLICES, at_level, num_shards
from autopart.schema import LEVELS, Plan, Profile
from autopart.schema.parts import level_name
from autopart.solve.cuts import parse_derived
from autopart.solve.records import Config
from autopart.solve.request import Request

__all__ = []

SLICE_MARGIN = 0.01
"""How much faster ``auto`` must predict the sliced plan to keep it."""
_CONFIGS_CARRIED = 3
"""Configurations of the first choice's search the other choices are searched over."""
_FINALIST_MARGIN = 0.02
"""A sliced choice this close to the fastest unsliced one before the local search is
refined too."""

PlanAt = Callable[[Profile, Request, Sequence[Config] | None,
                   Callable[[int, int, str], None] | None], tuple[Plan, list[Config]]]
"""``plan_at(profile at a level, request, configs or None, progress) -> (plan, ranked)``."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One level with the head whole or cut, and the parts per half at ``slice``."""

    level: str
    head_shards: int = 0
    slices: int = 0

    @property
    def label(self) -> str:
        """``projection, head in 12 shards``: for notes."""
        head = f", head in {self.head_shards} shards" if self.head_shards else ", head whole"
        return f"{self.level}{head}"


def choices(profile: Profile, request: Request) -> tuple[list[Choice], list[str]]:
    """The choices ``request`` asks for on ``profile`` (best first to search), and notes.

    With ``cuts`` that name no shard and the head to be split (``split_head``), the
    shards are all on the last stage.

    Raises:
        PlanError: Cut names ask for slices or shards in more than one count, or shards of
            a head to stay whole; FSDP with a split head or sliced halves.
    """
    opts = request.options
    measured = profile.setup.granularity
    notes: list[str] = []
    if opts.target is not None:
        if measured != "layer" or profile.model.head_split_rows:
            notes.append(f"{opts.target} cannot express cuts inside a layer or the head: "
                         f"planned at layer granularity")
        return [Choice("layer")], notes
    fsdp = opts.zero_stage == 3 and request.setup_fields.get("dp_size", 1) > 1
    if fsdp and opts.split_head is True:
        raise PlanError(f"a head split by vocabulary across stages cannot be sharded by FSDP "
                        f"(--dp-shard params-*, zero 3); {_FSDP_REMEDY}")
    if opts.cuts is not None:
        cut = _cut_choice(profile, opts.cuts)
        if cut.head_shards and opts.split_head is False:
            raise PlanError("--cuts name vocabulary shards of the head, but the head is to "
                            "stay whole (--head whole); name no shard, or drop --head whole")
        if not cut.head_shards and opts.split_head and _splits_head(profile):
            # the shards all on the last stage: no cut names them (plan_again of a plan
            # with shards, ``--head split --cuts ...``); any count prices them alike
            cut = dataclasses.replace(cut, head_shards=num_shards(profile))
        if fsdp and (cut.slices or cut.head_shards):
            raise PlanError(f"--cuts name slices or head shards, which FSDP (--dp-shard "
                            f"params-*, zero 3) cannot shard; {_FSDP_REMEDY}")
        return [cut], notes
    shards = num_shards(profile) if _splits_head(profile) and not fsdp else 0
    if opts.granularity == "auto":
        sliced = _slices(profile) and measured != "layer"
        levels = [measured] + (["slice"] if sliced and not fsdp else [])
        if fsdp and (sliced or _splits_head(profile)):
            notes.append("FSDP shards each block's parameters over dp: planned without "
                         "slices and with the head whole (the runtime shards neither)")
    else:
        level = level_name(opts.granularity)
        if fsdp and level == "slice":
            raise PlanError(f"FSDP (--dp-shard params-*, zero 3) cannot shard a layer half "
                            f"cut into slices; {_FSDP_REMEDY}")
        levels, why = [_offered(profile, level)], ""
        if levels[0] != level:
            why = (f"{level} level asked for, but {_why_not(profile, level)}: planned at "
                   f"{levels[0]}")
            notes.append(why)
    heads = [shards, 0] if shards and opts.split_head is not False else [0]
    if opts.split_head is True:
        if not shards:
            notes.append("the head cannot be split by vocabulary here (not an nn.Linear whose "
                         "output the model returns as is): kept whole")
        heads = [shards] if shards else [0]
    out = [Choice(level, head, 4 if level == "slice" else 0)
           for level in levels for head in heads if level != "layer" or not head
           or opts.granularity == "auto" or opts.split_head]
    return out or [Choice(levels[0])], notes


_FSDP_REMEDY = ("plan with --head whole and without slices, or shard only the optimizer "
                "(--dp-shard optimizer)")


def _cut_choice(profile: Profile, cuts: Sequence[str]) -> Choice:
    """The level and counts the cut names need: slices and shards named by ``<i>of<k>``."""
    counts: dict[str, set[int]] = {"units": set(), "vocab": set()}
    for name in cuts:
        parsed = parse_derived(name)
        if parsed is not None:
            counts[parsed[1]].add(parsed[3])
    if len(counts["vocab"]) > 1:
        raise PlanError(f"--cuts names shards of {sorted(counts['vocab'])} parts; all shard "
                        f"names must agree on K (<i>of<K>)")
    # A half is cut into min(K, its units) slices, so one plan names attention slices
    # of 2 (2 KV heads) beside MLP slices of 4: the largest K is the plan's; a name the
    # chain at that K lacks is refused with the other unknown names.
    slices = min(max(counts["units"], default=0), MAX_SLICES)
    shards = next(iter(counts["vocab"]), 0)
    level = "slice" if slices else profile.setup.granularity
    return Choice(level, shards, slices)


def _splits_head(profile: Profile) -> bool:
    head = profile.blocks[-1]
    return bool(profile.model.head_split_rows) and head.kind == "head" and not head.parts


def _slices(profile: Profile) -> bool:
    return bool(profile.model.slice_units)


def _offered(profile: Profile, level: str) -> str:
    """``level`` if the profile offers it, else the finest level it has below it."""
    measured = profile.setup.granularity
    if level == "slice":
        return level if _slices(profile) and measured != "layer" else measured
    return min(level, measured, key=LEVELS.index)


def _why_not(profile: Profile, level: str) -> str:
    if level == "slice":
        why = [n for n in profile.model.notes if "cannot be sliced" in n]
        return why[0] if why else "no half of this profile can be cut by units"
    return f"the profile holds {profile.setup.granularity}-level blocks"


def plan_levels(profile: Profile, request: Request, plan_at: PlanAt,
                progress: Callable[[int, int, str], None] | None) -> Plan:
    """The fastest plan over ``choices(profile, request)`` (module docstring).

    Every choice is searched without the local search first; then the fastest choice with
    whole halves and the fastest with slices (when within ``_FINALIST_MARGIN`` of it) are
    searched again over their best configurations with it, and the faster of those wins.

    Raises:
        PlanError: No choice fits or has the stages asked for (``_refusal``: the most
            blocks any choice has, where none has enough; else the first refusal of one
            that has, ``InfeasibleError`` where it did not fit memory). A choice that
            cannot, the head whole where only its shards give enough blocks for the
            stages, is passed over.
    """
    tried, notes = choices(profile, request)
    refine = request.search.refine_evals > 0 and len(tried) > 1
    scan = dataclasses.replace(request, search=dataclasses.replace(
        request.search, refine_evals=0)) if refine else request
    rounds = len(tried) + (2 if refine else 0)
    found: list[tuple[Choice, Plan, list[Config]]] = []
    errors: list[tuple[Choice, PlanError]] = []
    carried: list[Config] | None = None
    for k, choice in enumerate(tried):
        try:
            plan, ranked = plan_at(_profile_at(profile, choice), scan, carried,
                                   _progress(progress, k, rounds))
        except PlanError as exc:  # infeasible, or this level too coarse for the stages
            errors.append((choice, exc))
            continue
        if carried is None:
            carried = ranked[:_CONFIGS_CARRIED]
        found.append((choice, plan, ranked))
    if not found:
        raise _refusal(profile, errors, request)
    plans = [(c, p) for c, p, _ in found]
    if refine:
        finalists = _finalists(plans)
        refined = []
        for k, (choice, _) in enumerate(finalists):
            ranked = next(r for c, _, r in found if c == choice)
            refined.append((choice, plan_at(_profile_at(profile, choice), request,
                                            ranked[:_CONFIGS_CARRIED],
                                            _progress(progress, len(tried) + k, rounds))[0]))
        plans = [next((r for r in refined if r[0] == c), (c, p)) for c, p in plans]
        finalists = refined
    else:
        finalists = plans
    choice, best = _fastest(finalists)
    notes += choice_notes(profile, choice) + _alternatives(plans, choice)
    return dataclasses.replace(best, notes=(*best.notes, *notes))


def _refusal(profile: Profile, errors: list[tuple[Choice, PlanError]], request: Request
             ) -> PlanError:
    """Why no choice planned. Where every choice has fewer blocks than the stages asked
    for, a refusal that names the most any choice has: the first choice's count, which its
    own refusal names, is not the limit where slices or head shards add blocks. Else the
    first refusal of a choice with blocks enough (memory, usually)."""
    fixed = request.virtual_stages
    many = isinstance(fixed, int) and fixed > 1
    stages = request.options.pp_size * (fixed if many else 1)
    counted = [(len(_profile_at(profile, c).blocks), c, exc) for c, exc in errors]
    most, widest, _ = max(counted, key=lambda item: item[0])
    if stages <= most:
        return next(exc for num, _, exc in counted if num >= stages)
    asked = (f"pp_size * virtual_stages ({request.options.pp_size} * {fixed})" if many
             else f"pp_size ({stages})")
    return PlanError(f"{asked} exceeds the number of blocks of {profile.model.name!r} at "
                     f"its finest cuts the options allow ({most}: {widest.label}); lower "
                     f"{'--pp or --virtual-stages' if many else '--pp'} to at most {most} "
                     f"stages in all")


def _finalists(plans: list[tuple[Choice, Plan]]) -> list[tuple[Choice, Plan]]:
    """The fastest choice with whole halves, and the fastest with slices when it is within
    ``_FINALIST_MARGIN`` of it (the local search may still make it ``SLICE_MARGIN`` faster)."""
    def key(cp: tuple[Choice, Plan]) -> tuple[float, bool]:
        return cp[1].predicted_step_ms, cp[0].head_shards > 0

    whole = sorted((cp for cp in plans if cp[0].level != "slice"), key=key)
    sliced = sorted((cp for cp in plans if cp[0].level == "slice"), key=key)
    if not whole:
        return sliced[:1]
    out = whole[:1]
    if sliced and sliced[0][1].predicted_step_ms < (1 + _FINALIST_MARGIN) * \
            whole[0][1].predicted_step_ms:
        out.append(sliced[0])
    return out


def choice_notes(profile: Profile, choice: Choice) -> list[str]:
    """What a plan at ``choice`` derives by fraction and holds whole: one line for halves
    cut by units, one for the head cut by vocabulary."""
    out = []
    units = profile.model.slice_units
    if choice.level == "slice" and units:
        what = {"attention": "KV-head groups", "mlp": "column groups"}
        kinds = ", ".join(f"{k} into {min(choice.slices or 4, u)} {what.get(k, 'parts')}"
                          for k, u in sorted(units.items()))
        out.append(f"halves cut inside their call: {kinds}, costs by unit fraction; a rank "
                   f"with a slice holds its half whole and sums its gradient with the other "
                   f"holder after the step")
    if choice.head_shards:
        head = profile.blocks[-1]
        grad_ms = profile.setup.head_grad_ms
        grad = (f"{grad_ms:.3g} ms, {profile.setup.time_source.split(':')[0]}" if grad_ms > 0
                else "not in this profile: re-profile to count it")
        out.append(f"{head.name} split into {choice.head_shards} vocabulary shards, costs by "
                   f"vocabulary fraction; every rank with a shard holds the whole head weight "
                   f"({head.num_params / 1e6:.1f}M parameters, counted once per rank), "
                   f"zero-fills its gradient once per step ({grad}) and sums it with the "
                   f"other holders after the step")
    return out


def _profile_at(profile: Profile, choice: Choice) -> Profile:
    return at_level(profile, choice.level, choice.head_shards, choice.slices or 4)


def _fastest(plans: list[tuple[Choice, Plan]]) -> tuple[Choice, Plan]:
    """The fastest plan; a sliced one must be ``SLICE_MARGIN`` faster than the fastest
    unsliced one, a split head strictly faster than the same level with the head whole
    (earlier choices win ties)."""
    whole = [(c, p) for c, p in plans if c.level != "slice"]
    sliced = [(c, p) for c, p in plans if c.level == "slice"]
    def key(cp: tuple[Choice, Plan]) -> tuple[float, bool]:
        return cp[1].predicted_step_ms, cp[0].head_shards > 0

    best = min(whole, key=key) if whole else None
    fine = min(sliced, key=key) if sliced else None
    if best is None or (fine is not None and fine[1].predicted_step_ms
                        < (1 - SLICE_MARGIN) * best[1].predicted_step_ms):
        assert fine is not None
        return fine
    return best


def _alternatives(plans: list[tuple[Choice, Plan]], chosen: Choice) -> list[str]:
    """One line on what else was tried, when anything was."""
    if len(plans) < 2:
        return []
    others = ", ".join(f"{c.label} {p.predicted_step_ms:.1f} ms" for c, p in plans
                       if c != chosen)
    return [f"granularity: {chosen.label} chosen; also predicted: {others} (choices after the "
            f"first searched over its {_CONFIGS_CARRIED} best schedule/v/m, the local search "
            f"on the fastest; slices kept only when {SLICE_MARGIN:.0%} faster)"]


def _progress(progress: Callable[[int, int, str], None] | None, k: int, num: int
              ) -> Callable[[int, int, str], None] | None:
    """Progress of choice ``k`` of ``num`` as one bar."""
    if progress is None:
        return None
    return lambda done, total, what: progress(k * total + done, num * total, what)

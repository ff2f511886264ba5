"""Cut names: a cut is the point after a module; any name whose end is a block boundary.

The point after block ``j`` may be named by the block (``model.layers.2.mlp``,
``lm_head.shard3of46``), by the last module it runs, or by any module whose call ends
there: the module of every part of the block that is its module's last part
(``model.layers.2`` after its MLP half, ``model.layers.2.self_attn`` after the attention
half's output projection). A plan's ``pipeline_cuts`` gives each cut its shortest name;
``--cuts`` accepts every name of a boundary of the level the names need.

A derived part's name says which level and how many parts it needs
(``<module>.slice<i>of<k>``: the ``slice`` level with ``k`` parts per half;
``<module>.shard<i>of<k>``: the head in ``k`` parts): ``parse_derived`` reads that from the
user's text, the one place a part is read from a name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from autopart.errors import PlanError
from autopart.schema import BlockProfile, Profile

__all__ = []

_DERIVED = re.compile(r"^(?P<module>.+)\.(?P<what>shard|slice)(?P<idx>\d+)of(?P<num>\d+)$")


def parse_derived(name: str) -> tuple[str, str, int, int] | None:
    """``(module, axis, index, count)`` of a derived part's name (``...slice1of4``: axis
    ``units``; ``...shard3of46``: ``vocab``), or ``None`` for other names."""
    match = _DERIVED.match(name)
    if match is None:
        return None
    return (match["module"], "vocab" if match["what"] == "shard" else "units",
            int(match["idx"]), int(match["num"]))


def _ending(block: BlockProfile) -> list[str]:
    """The names of the point after ``block``: its name, its last module (unless the block
    is a derived part, a slice or head shard, which runs only a share of that module's
    call), and the module of each part whose call ends with it (that part and every part
    inside it are last)."""
    names = [block.name]
    if not (block.parts and block.parts[-1].derived):
        names.append((block.modules or (block.name,))[-1])
    for depth, part in enumerate(block.parts):
        if all(p.last for p in block.parts[depth:]):
            names.append(part.module)
    return list(dict.fromkeys(names))


def boundary_names(blocks: Sequence[BlockProfile]) -> dict[str, int]:
    """Every name of a cut between blocks: name -> ``j``, the cut after block ``j - 1``
    (``1 .. n - 1``)."""
    out: dict[str, int] = {}
    for j, block in enumerate(blocks[:-1], 1):
        for name in _ending(block):
            out.setdefault(name, j)
    return out


def shortest_names(blocks: Sequence[BlockProfile], ends: Sequence[int]) -> list[str]:
    """The shortest name of the cut after block ``j - 1`` for each ``j`` in ``ends``
    (ties: the block's own name, then alphabetical)."""
    out = []
    for j in ends:
        names = _ending(blocks[j - 1])
        out.append(min(names, key=lambda n: (len(n), n != blocks[j - 1].name, n)))
    return out


def cut_bounds(profile: Profile, cuts: Sequence[str], pp_size: int,
               virtual_stages: int | str) -> tuple[tuple[tuple[int, int], ...], int]:
    """Stage bounds and v of a split given as ``pipeline_cuts``: the point after the last
    module of every stage but the final one, by any of its names.

    Args:
        profile: The profile to plan on, at the level the names need.
        cuts: ``pp_size * v - 1`` cut names in model order.
        pp_size: Pipeline ranks.
        virtual_stages: v, or ``"auto"`` to take it from the number of cuts.

    Returns:
        ``((first, stop), ...)`` block ranges of the stages, and v.

    Raises:
        PlanError: a name is not a cut of this profile (with the names nearby), the
            names are out of order or repeat, or their count is not ``pp * v - 1``.
    """
    blocks = profile.blocks
    index = boundary_names(blocks)
    positions = []
    for cut in cuts:
        if cut not in index:
            raise PlanError(_unknown(profile, cut, index))
        positions.append(index[cut])
    for a, b, name in zip(positions, positions[1:], cuts[1:]):
        if b <= a:
            raise PlanError(f"--cuts must follow model order, each once: {name!r} does not "
                            f"come after the cut before it; list the cuts from the first "
                            f"module to the last")
    count = len(cuts) + 1
    if virtual_stages == "auto":
        virtual = count // pp_size
        if count % pp_size:
            raise PlanError(f"--cuts gives {len(cuts)} cut(s) ({count} stages), expected "
                            f"pp * v - 1 ({pp_size - 1}, {2 * pp_size - 1}, ... for pp "
                            f"{pp_size}); give pp * v - 1 names")
    elif count != pp_size * virtual_stages:
        raise PlanError(f"--cuts gives {len(cuts)} cut(s) ({count} stages), expected pp * v "
                        f"- 1 = {pp_size * virtual_stages - 1} for pp {pp_size}, v "
                        f"{virtual_stages}; give pp * v - 1 names")
    else:
        virtual = virtual_stages
    starts = [0, *positions, len(blocks)]
    return tuple(zip(starts[:-1], starts[1:])), virtual


def _unknown(profile: Profile, cut: str, index: dict[str, int]) -> str:
    """One line: why ``cut`` is no cut of ``profile``, and what would be."""
    blocks = profile.blocks
    last = blocks[-1]
    if cut in _ending(last) or any(cut == p.module for p in last.parts):
        return (f"--cuts names {cut!r}, the end of the model: a cut ends a stage that has "
                f"a stage after it")
    inside = [b.name for b in blocks if any(
        f == cut or f.startswith(cut + ".") or cut.startswith(f + ".")
        for f in (b.modules or (b.name,))) or any(p.module == cut for p in b.parts)]
    level = profile.setup.granularity
    if parse_derived(cut) is not None:
        why = ("slices exist where the profile offers them (ModelInfo.slice_units), at most "
               "64 and the half's units per half, all names agreeing on K; head shards where "
               "the head can be split, all names agreeing on K")
    elif inside:
        nearby = [n for n, j in index.items() if blocks[j - 1].name in inside][:3]
        why = (f"its call ends inside a block at the {level} level (cuts there: "
               f"{', '.join(nearby) or 'none'}); plan and profile at a finer level (the "
               f"defaults of `autopart plan` and `autopart profile`)")
    else:
        why = f"no module of the profile has that name (blocks: {blocks[0].name} .. {last.name})"
    return f"--cuts names {cut!r}, which is not a cut of the profile: {why}"

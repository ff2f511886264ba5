"""Small parsing and formatting helpers shared by the commands."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from autopart.errors import AutopartError
from autopart.schema import Part

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """``80GiB`` / ``24GB`` / ``512MiB`` / ``1000000`` -> bytes; one-line error otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise AutopartError(f"{flag} {text!r} is not a size; write e.g. 80GiB, 24GB or 512MiB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise AutopartError(f"{flag} must be positive, got {text!r}")
    return int(value)


def gib(num_bytes: float) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB)."""
    if num_bytes < 2**30:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**30:.2f} GiB"


def summarize_modules(modules: Sequence[str],
                      parts: Mapping[str, tuple[Part, ...]] | None = None) -> str:
    """A stage's blocks in a few words: ``[a.layers.0, a.layers.1, a.layers.2, b]`` ->
    ``a.layers.0-2, b``. With the plan's ``parts``, every run of blocks that is all the parts
    of a module's call is that module (a layer's halves: the layer; all of a half's slices:
    the half; all of the head's shards: the head), and a run of some of a module's slices
    or shards is a range (``lm_head.shard0-2of4``)."""
    entries = _whole_modules([(m, tuple((parts or {}).get(m, ()))) for m in modules])
    out: list[str] = []
    run_prefix, run_start, run_end = None, None, None

    def flush() -> None:
        if run_prefix is not None:
            out.append(f"{run_prefix}{run_start}" if run_start == run_end
                       else f"{run_prefix}{run_start}-{run_end}")

    for name in _part_ranges(entries):
        match = re.fullmatch(r"(.*\.)(\d+)", name)
        if match and match.group(1) == run_prefix and int(match.group(2)) == run_end + 1:
            run_end += 1
            continue
        flush()
        if match:
            run_prefix = match.group(1)
            run_start = run_end = int(match.group(2))
        else:
            run_prefix = None
            out.append(name)
    flush()
    return ", ".join(out)


Entry = tuple[str, tuple[Part, ...]]


def _whole_modules(entries: list[Entry]) -> list[Entry]:
    """Runs that hold every part of a module's call, replaced by the module, innermost
    first, until none is left."""
    changed = True
    while changed:
        changed = False
        for i, (_, parts) in enumerate(entries):
            if not parts or parts[-1].index != 0:
                continue
            last = parts[-1]
            run = entries[i:i + last.count]
            if len(run) == last.count and all(
                    p[:-1] == parts[:-1] and p and (p[-1].module, p[-1].axis, p[-1].index)
                    == (last.module, last.axis, k) for k, (_, p) in enumerate(run)):
                entries = [*entries[:i], (last.module, parts[:-1]), *entries[i + last.count:]]
                changed = True
                break
    return entries


def _part_ranges(entries: list[Entry]) -> list[str]:
    """Names, consecutive slices or shards of one module as ``module.slice1-3of4``."""
    out: list[str] = []
    runs: list[tuple[Part, int] | None] = []  # (first part, last index) per output slot
    for name, parts in entries:
        part = parts[-1] if parts and parts[-1].derived else None
        prev = runs[-1] if runs else None
        if part and prev and (prev[0].module, prev[0].axis) == (part.module, part.axis) \
                and prev[1] + 1 == part.index:
            runs[-1] = (prev[0], part.index)
            word = "slice" if part.axis == "units" else "shard"
            out[-1] = f"{part.module}.{word}{prev[0].index}-{part.index}of{part.count}"
            continue
        runs.append((part, part.index) if part else None)
        out.append(name)
    return out

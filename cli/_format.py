"""Small parsing and formatting helpers shared by the commands."""

from __future__ import annotations

import re

from autopart.errors import AutopartError
from autopart.intake.half_slices import parse_slice
from autopart.intake.head_split import parse_shard

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


def summarize_modules(modules: list[str] | tuple[str, ...]) -> str:
    """``[a.layers.0, a.layers.1, a.layers.2, b]`` -> ``a.layers.0-2, b``; head shards
    ``lm_head.shard0of4 .. lm_head.shard2of4`` -> ``lm_head.shard0-2of4``, half slices
    likewise (all of a half's slices: the half); a layer's consecutive halves
    (``a.layers.0.self_attn, a.layers.0.mlp``) -> the layer."""
    modules = _whole_layers(_summarize_parts(modules))
    out: list[str] = []
    run_prefix, run_start, run_end = None, None, None

    def flush() -> None:
        if run_prefix is not None:
            out.append(f"{run_prefix}{run_start}" if run_start == run_end
                       else f"{run_prefix}{run_start}-{run_end}")

    for name in modules:
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


def _summarize_parts(modules: list[str] | tuple[str, ...]) -> list[str]:
    out: list[str] = []
    runs: list[tuple] = []  # (block, first, last, num, word) per output slot, () for others
    for name in modules:
        shard = parse_shard(name)
        parsed, word = (shard, "shard") if shard else (parse_slice(name), "slice")
        if parsed and runs and runs[-1] and runs[-1][0] == parsed[0] \
                and runs[-1][2] + 1 == parsed[1]:
            block, first, _, num, _ = runs[-1]
            runs[-1] = (block, first, parsed[1], num, word)
            whole = word == "slice" and first == 0 and parsed[1] == num - 1
            out[-1] = block if whole else f"{block}.{word}{first}-{parsed[1]}of{num}"
            continue
        runs.append((parsed[0], parsed[1], parsed[1], parsed[2], word) if parsed else ())
        out.append(name)
    return out


def _whole_layers(modules: list[str]) -> list[str]:
    """Consecutive halves of one numbered layer (``x.3.self_attn, x.3.mlp``) -> ``x.3``."""
    out: list[str] = []
    parents: list[str] = []
    for name in modules:
        parent = name.rpartition(".")[0]
        if parent and re.fullmatch(r".*\.\d+", parent) and parents and parents[-1] == parent:
            out[-1] = parent
            continue
        parents.append(parent)
        out.append(name)
    return out

"""Profiles and plans of schema 1, read into schema 2 (typed parts, new level names).

Schema 1 carried a block's part in its name (``lm_head.shard2of46``,
``model.layers.3.mlp.slice1of4``) and a layer half in ``BlockProfile.layer``. This is the
one place that still reads parts from names: once, when an old file is loaded.
"""

from __future__ import annotations

import re
from typing import Any

from autopart.schema.parts import LEVEL_ALIASES

__all__ = []

_DERIVED = re.compile(r"^(?P<module>.+)\.(?P<what>shard|slice)(?P<idx>\d+)of(?P<num>\d+)$")
_HALF_INDEX = {"attention": 0, "mlp": 1}


def profile_from_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema 1 profile's JSON object in schema 2's shape.

    ``setup.granularity`` gets its new name; a block's ``layer`` becomes its half's part
    of the layer, and at ``quarter`` the two blocks of a half are parts of its main module
    (the parent of the second block's first module, its output projection).
    """
    setup = dict(data.get("setup") or {})
    if "granularity" in setup:
        setup["granularity"] = LEVEL_ALIASES.get(setup["granularity"], setup["granularity"])
    raw = [dict(b) for b in data.get("blocks") or [] if isinstance(b, dict)]
    pieces: dict[tuple[str, str], list[int]] = {}
    for i, block in enumerate(raw):
        layer = block.pop("layer", "")
        if layer:
            pieces.setdefault((layer, block.get("kind", "")), []).append(i)
    relative: dict[str, str] = {}
    for (layer, kind), where in pieces.items():
        half = {"module": layer, "axis": "calls", "index": _HALF_INDEX.get(kind, 0), "count": 2}
        for i in where:
            raw[i]["parts"] = [half]
        if len(where) == 2:
            second = raw[where[1]]
            module = (second.get("modules") or [second.get("name", "")])[0].rsplit(".", 1)[0]
            for n, i in enumerate(where):
                raw[i]["parts"] = [half, {"module": module, "axis": "calls", "index": n,
                                          "count": 2}]
        else:
            module = raw[where[0]].get("name", "")
        if module.startswith(layer + "."):
            relative.setdefault(kind, module[len(layer) + 1:])
    model = dict(data.get("model") or {})
    units = model.get("slice_units") or {}
    model["slice_modules"] = {k: relative[k] for k in units if k in relative}
    return {**data, "setup": setup, "blocks": raw, "model": model}


def plan_from_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema 1 plan's JSON object in schema 2's shape: the level's new name (``slice``
    where a block is a slice) and the derived parts read from the stages' block names."""
    parts: dict[str, list[dict[str, Any]]] = {}
    for stage in data.get("stages") or []:
        for name in stage.get("modules") or [] if isinstance(stage, dict) else []:
            match = _DERIVED.match(name) if isinstance(name, str) else None
            if match and int(match["idx"]) < int(match["num"]):
                axis = "vocab" if match["what"] == "shard" else "units"
                parts[name] = [{"module": match["module"], "axis": axis,
                                "index": int(match["idx"]), "count": int(match["num"])}]
    level = data.get("granularity", "layer")
    level = LEVEL_ALIASES.get(level, level) if isinstance(level, str) else level
    if any(p[0]["axis"] == "units" for p in parts.values()):
        level = "slice"
    shards = {p[0]["count"] for p in parts.values() if p[0]["axis"] == "vocab"}
    return {**data, "granularity": level, "parts": parts, "stages": _stages_from_v1(data),
            "head_shards": min(shards) if shards else 0}


def _stages_from_v1(data: dict[str, Any]) -> list[Any]:
    """Stages with schema 1's shared-weight fields as ``held`` modules: the tied or split
    head's whole weight (schema 1 left it out of a stage's static bytes and added it per
    rank) and a half cut between two stages (held by both)."""
    stages = [dict(s) if isinstance(s, dict) else s for s in data.get("stages") or []]
    names = [m for s in stages if isinstance(s, dict) for m in s.get("modules") or []]
    head = names[-1] if names else ""
    match = _DERIVED.match(head) if isinstance(head, str) else None
    head = match["module"] if match else head
    for k, stage in enumerate(stages):
        if not isinstance(stage, dict):
            continue
        held = stage.setdefault("held", [])
        tied, part = stage.pop("tied_static_bytes", 0), stage.pop("tied_part_bytes", 0)
        if part and isinstance(stage.get("static_bytes"), int):
            stage["static_bytes"] += tied - part
            held.append({"module": head, "static_bytes": tied})
        shared = stage.pop("shared_half_bytes", 0)
        last = (stage.get("modules") or [""])[-1]
        match = _DERIVED.match(last) if shared and isinstance(last, str) else None
        if match:
            entry = {"module": match["module"], "static_bytes": shared}
            held.append(entry)
            if k + 1 < len(stages) and isinstance(stages[k + 1], dict):
                stages[k + 1].setdefault("held", []).append(entry)
    return stages

"""A block that is part of a module's call, as typed data (``Part``), and the levels of cut.

A block is usually a module (an embedding, a decoder layer, the head). At finer levels a
block is one *part* of a module's call, and says so with ``Part``: which module's call
is cut, along which axis, which part and of how many. A block inside two cut modules
lists both, outermost first (a layer's attention half cut before its output projection:
``(Part(model.layers.2, calls, 0, 2), Part(model.layers.2.self_attn, calls, 0, 2))``).
Names are for people (``model.layers.2.mlp.slice1of4``, ``lm_head.shard3of46``); no code
reads a part from a name.

Three axes:

- ``calls``: consecutive pieces of the call that run one after another (a decoder
  layer's halves; a half before and from its output projection). Measured blocks.
- ``units``: a sum over independent units (a half's KV-head groups, MLP column groups);
  each part computes its units' share of the module's output. Derived by unit fraction.
- ``vocab``: rows of the head's output (vocabulary shards), the loss carried as a
  running log-sum-exp. Derived by vocabulary fraction.

A module cut along ``units`` or ``vocab`` is held whole by every rank holding one of its
parts, and its gradient is summed over them (``autopart.cost.stage``).

The **levels** (``LEVELS``) are one ordered list of the sequential cuts a plan may use:
``layer`` (whole decoder layers), ``half`` (their attention and MLP halves),
``projection`` (halves cut before their output projection too), ``slice`` (halves cut
inside their call by units). The head is whole or in vocabulary shards at every level.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.errors import SchemaError

__all__ = ["LEVELS", "LEVEL_ALIASES", "Part", "derived_name", "level_name"]

AXES = ("calls", "units", "vocab")
"""How a module's call is cut (module docstring)."""
LEVELS = ("layer", "half", "projection", "slice")
"""The levels, coarse to fine: the cuts each allows (module docstring)."""
LEVEL_ALIASES = {"sublayer": "half", "quarter": "projection"}
"""Names of schema 1 and earlier flags for the same levels."""
_SUFFIX = {"units": "slice", "vocab": "shard"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """The block is part ``index`` of ``count`` of ``module``'s call, cut along ``axis``."""

    module: str
    """FQN of the module whose call is cut (a decoder layer, a half's main module, the head)."""
    axis: str
    """``calls``, ``units`` or ``vocab`` (``AXES``)."""
    index: int
    """Which part, from 0."""
    count: int
    """How many parts the call is cut into (at least 2)."""

    def __post_init__(self) -> None:
        if self.axis not in AXES:
            raise SchemaError(f"part of {self.module!r} has axis {self.axis!r}, expected one "
                              f"of {AXES}")
        if not (isinstance(self.count, int) and isinstance(self.index, int)
                and self.count >= 2 and 0 <= self.index < self.count):
            raise SchemaError(f"part {self.index} of {self.count} of {self.module!r}: expected "
                              f"count >= 2 and 0 <= index < count")

    @property
    def derived(self) -> bool:
        """Costs by fraction of a measured block (``units``, ``vocab``), not measured."""
        return self.axis != "calls"

    @property
    def first(self) -> bool:
        """The first part of its module."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """The last part of its module."""
        return self.index == self.count - 1


def derived_name(module: str, axis: str, index: int, count: int) -> str:
    """The name of a derived part block: ``<module>.slice<i>of<k>`` (units) or
    ``<module>.shard<i>of<k>`` (vocab)."""
    return f"{module}.{_SUFFIX[axis]}{index}of{count}"


def level_name(name: str) -> str:
    """A level's name from a flag value or a schema 1 file (``sublayer`` -> ``half``).

    Raises:
        SchemaError: ``name`` is not a level.
    """
    level = LEVEL_ALIASES.get(name, name)
    if level not in LEVELS:
        raise SchemaError(f"granularity {name!r} is not one of {', '.join(LEVELS)}")
    return level

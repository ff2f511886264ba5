"""Which layer halves a profile offers to cut inside their call (``ModelInfo.slice_units``).

Every call of a half's module ``P`` (``autopart.intake.slice_rules``) whose structure
gives a ``SliceRule`` is a candidate. For each kind (``attention``, ``mlp``) the first
such call of each module class is checked on the profiling backend while the forward
runs: ``P`` (a materialized copy) whole against ``P`` as two slices on the call's own
arguments (numerically on cpu and cuda, by shapes on meta). A kind is offered only
when every half of that kind has a rule, all with the same units, and the checks
passed; otherwise a note says why not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from autopart.intake import BlockChain
from autopart.intake.slice_rules import SliceRule, check_slices, slice_rule
from autopart.profile.tasks import on_device

__all__ = []

_KINDS = ("attention", "mlp")


class SliceChecks:
    """Collects, while the profiler's forward runs, which half kinds can be sliced."""

    def __init__(self, model: nn.Module, chain: BlockChain) -> None:
        self._calls: dict[int, tuple[str, SliceRule]] = {}
        self._relative: dict[str, set[str]] = {k: set() for k in _KINDS}
        # (layer, kind) -> the half's calls (two blocks at the projection level)
        halves: dict[tuple[str, str], list[int]] = {}
        for block in chain.blocks:
            if block.layer and block.kind in _KINDS:
                halves.setdefault((block.layer, block.kind), []).extend(block.calls)
        self._halves = {k: sum(1 for _, kind in halves if kind == k) for k in _KINDS}
        self._why: dict[str, str] = {}
        seen: dict[str, set] = {k: set() for k in _KINDS}
        for (layer, kind), calls in halves.items():
            modules = [model.get_submodule(chain.call_fqns[call]) for call in calls]
            found = [(call, *slice_rule(m)) for call, m in zip(calls, modules)]
            ruled = [(call, rule) for call, rule, _ in found if rule is not None]
            if ruled:
                self._calls[ruled[0][0]] = (kind, ruled[0][1])
                seen[kind].add(ruled[0][1].units)
                self._relative[kind].add(chain.call_fqns[ruled[0][0]][len(layer) + 1:])
            else:
                main = max(range(len(calls)), key=lambda i: _size(modules[i]))
                self._why.setdefault(kind, found[main][2])  # the half's largest module's
        self._units = {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}
        for kind, units in seen.items():
            if len(units) > 1:
                self._why[kind] = f"{kind} halves differ in their units ({sorted(units)})"
            elif len(self._relative[kind]) > 1:
                self._why[kind] = (f"{kind} halves sum over differently named modules "
                                   f"({sorted(self._relative[kind])})")
        self._checked: set[tuple[str, str]] = set()

    def visit(self, idx: int, original: nn.Module, args: tuple, kwargs: dict,
              materialize: Callable[[nn.Module], nn.Module], device: torch.device) -> None:
        """Check the slices of call ``idx`` if it is the first of its kind and class."""
        if idx not in self._calls:
            return
        kind, rule = self._calls[idx]
        key = (kind, type(original).__name__)
        if key in self._checked or kind in self._why:
            return
        self._checked.add(key)
        module = materialize(original)
        a, kw = tree_map_only(torch.Tensor, lambda t: on_device(t, device), (args, kwargs))
        why = check_slices(module, rule, a, kw)
        if why:
            self._why[kind] = why

    def units(self) -> dict[str, int]:
        """``{kind: units}`` of the kinds every half of which can be sliced."""
        counted = {k: sum(1 for kind, _ in self._calls.values() if kind == k) for k in _KINDS}
        return {k: u for k, u in sorted(self._units.items())
                if k not in self._why and counted[k] == self._halves[k] > 0}

    def modules(self) -> dict[str, str]:
        """``{kind: name}`` of the module each offered kind's halves sum over units, by its
        name inside the layer (``ModelInfo.slice_modules``)."""
        return {k: next(iter(self._relative[k])) for k in self.units()}

    def notes(self) -> list[str]:
        """One line per half kind that stays uncut inside its call, with the reason."""
        return [f"{kind} halves cannot be sliced: {why}" for kind, why in sorted(self._why.items())
                if self._halves[kind]]


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


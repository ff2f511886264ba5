"""Pruned copies of a model tree that keep the original module FQNs.

A rank holds only some blocks of the model. ``prune`` builds a new tree of plain
containers that registers just those block modules under their original paths,
so ``named_parameters()`` and ``state_dict()`` report the FQNs of the full model
(``model.layers.3.mlp.up_proj.weight``) and other stages' blocks are simply absent.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = []


class Tree(nn.Module):
    """A plain container; integer indexing reaches children named ``"0"``, ``"1"``, ...

    It stands in for the ``ModuleList`` of decoder layers too: ``len()`` reports the
    length of the original list (set by ``prune``), indexing returns a held layer.
    """

    def __init__(self, length: int = 0) -> None:
        super().__init__()
        self._length = length

    def __getitem__(self, idx: int) -> nn.Module:
        return self._modules[str(idx)]

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return True  # a module is truthy even when it stands in for an empty list


def prune(root: nn.Module, fqns: Iterable[str], into: Tree | None = None) -> Tree:
    """A ``Tree`` holding the modules of ``root`` named by ``fqns`` (the same objects).

    Intermediate containers are new ``Tree`` objects; where the original container
    is a ``ModuleList`` the ``Tree`` reports its original length. ``into`` fills an
    existing (e.g. stage) module instead of a new ``Tree``.
    """
    tree = into if into is not None else Tree()
    for fqn in fqns:
        *parents, leaf = fqn.split(".")
        node, orig = tree, root
        for part in parents:
            orig = orig.get_submodule(part)
            if part not in node._modules:
                length = len(orig) if isinstance(orig, nn.ModuleList) else 0
                node.add_module(part, Tree(length))
            node = node._modules[part]
        node.add_module(leaf, orig.get_submodule(leaf))
    return tree

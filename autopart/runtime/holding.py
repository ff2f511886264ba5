"""What this rank holds: its blocks given real storage, and the weights held on several ranks.

``materialize_rank`` prunes the model to this rank's blocks and materializes them
(``autopart.runtime.materialize``); ``share_across_ranks`` finds each weight held whole on
several pipeline ranks (a tied embedding and head, a head split by vocabulary, a half cut
into slices), gives its holders one group and the same initial values; their gradients
are summed over that group after every step (``autopart.runtime.pipeline``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopart.errors import RuntimeSetupError
from autopart.intake import BlockChain
from autopart.intake.sources import move_outside_blocks
from autopart.runtime.groups import Groups
from autopart.runtime.materialize import materialize_blocks
from autopart.runtime.pipeline import TiedWeight
from autopart.runtime.planned import base_names, derived_parts
from autopart.runtime.tensor_parallel import local_tensor
from autopart.runtime.tree import prune
from autopart.schema import Plan, StagePlan

__all__ = []


def tied_parameters(root: nn.Module, chain: BlockChain) -> list[tuple[str, str]]:
    """``(first, later)`` FQNs of parameters that two blocks share (tied embedding and head)."""
    owner: dict[int, tuple[str, str]] = {}
    ties: list[tuple[str, str]] = []
    for block in chain.blocks:
        for fqn in block.fqns:
            for name, p in root.get_submodule(fqn).named_parameters(remove_duplicate=False):
                full = f"{fqn}.{name}"
                if id(p) not in owner:
                    owner[id(p)] = (block.name, full)
                elif owner[id(p)][0] != block.name:
                    ties.append((owner[id(p)][1], full))
    return ties


def _block_of(chain: BlockChain, param_fqn: str) -> str:
    return next(b.name for b in chain.blocks for f in b.fqns if param_fqn.startswith(f + "."))


def materialize_rank(root: nn.Module, chain: BlockChain, mine: list[StagePlan],
                 device: torch.device, ties: list[tuple[str, str]], **kwargs) -> nn.Module:
    """Real storage for this rank's blocks; the model's code between blocks moved to ``device``."""
    index = {name: i for i, name in enumerate(chain.names)}
    blocks = {b.name: b for b in chain.blocks}
    owned = [(index[name], fqn) for stage in mine for name in stage.modules
             for fqn in blocks[name].fqns]
    owned = list(dict.fromkeys(owned))  # stages of one rank may share the split head
    fqns = [fqn for _, fqn in owned]
    if kwargs.get("dtype") is not None:  # the others too: their stand-ins answer in it
        for fqn in dict.fromkeys(f for b in chain.blocks for f in b.fqns):
            if fqn not in fqns:
                root.get_submodule(fqn).to(kwargs["dtype"])
    module = prune(root, [*fqns, *chain.shared_modules])
    materialize_blocks(root, owned, device=device, **kwargs)
    move_outside_blocks(root, chain.call_fqns, device)
    for first, later in ties:
        if any(first.startswith(f + ".") for f in fqns) and \
                any(later.startswith(f + ".") for f in fqns):
            holder, _, leaf = later.rpartition(".")
            setattr(module.get_submodule(holder), leaf, module.get_parameter(first))
    if hasattr(root, "config"):
        module.config = root.config
    module.train()
    return module


def share_across_ranks(module: nn.Module, plan: Plan, chain: BlockChain, groups: Groups,
                        ties: list[tuple[str, str]]) -> list[TiedWeight]:
    """Weights held on several ranks, each with a group of its holders, same initial values.

    A tied embedding/head weight is held by the embedding's rank and the head's; a
    head split by vocabulary, or a half cut into slices, is held whole by every rank with
    one of its shards or slices.
    """
    if len(ties) > 1:
        raise RuntimeSetupError(f"{len(ties)} parameters are shared between blocks (e.g. "
                                f"{ties[1][1]}); autopart keeps one shared weight in sync "
                                f"across ranks; untie the others")
    ranks_of: dict[str, set[int]] = {}
    for stage in plan.stages:
        for name in base_names(plan, chain, stage.modules):
            ranks_of.setdefault(name, set()).add(stage.rank)
    holders: dict[str, set[int]] = {}  # parameter FQN -> ranks holding it
    for first, later in ties:
        ranks = ranks_of[_block_of(chain, first)] | ranks_of[_block_of(chain, later)]
        holders[first if groups.pp_rank in ranks_of[_block_of(chain, first)] else later] = ranks
    head = chain.blocks[-1].name
    tied_fqns = {f for pair in ties for f in pair}
    for name, _ in module.named_parameters():
        if name.startswith(head + ".") and name not in tied_fqns:
            holders[name] = ranks_of[head]
    blocks = {b.name: b for b in chain.blocks}
    for half in {d.base for d in derived_parts(plan, chain) if d.part.axis == "units"}:
        prefixes = tuple(f + "." for f in blocks[half].fqns)
        for name, _ in module.named_parameters():
            if name.startswith(prefixes):
                holders[name] = ranks_of[half]
    shared, made = [], {}
    for fqn, ranks in sorted(holders.items()):
        if len(ranks) < 2 or groups.pp_rank not in ranks:
            continue
        key = tuple(sorted(ranks))
        if key not in made:
            made[key] = dist.new_group([groups.pp_global_ranks[r] for r in key],
                                       use_local_synchronization=True)
        param = module.get_parameter(fqn)
        with torch.no_grad():
            dist.broadcast(local_tensor(param.data), src=groups.pp_global_ranks[key[0]],
                           group=made[key])
        shared.append(TiedWeight(name=fqn, param=param, group=made[key],
                                 counts_in_norm=groups.pp_rank == key[0]))
    return shared

"""Discover the ordered chain of blocks of a model, named by their original FQNs.

* HF decoder-only causal LMs (Llama, Qwen2/Qwen3, Mistral and anything built on
  the same conventions): embedding, each decoder layer (class found from
  ``_no_split_modules``), final norm, head (the loss runs inside the head block).
* ``nn.Sequential``: its children.
* Otherwise: the repeated blocks of the largest ``ModuleList`` (or of the user's
  ``layer_classes``), with the parameter-holding modules before and after it.
  Such a chain is run as a straight line: each block takes the previous output.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from torch import nn

from autopart.errors import ModelSourceError

__all__ = ["Block", "BlockChain", "discover_blocks"]

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Block:
    """One unit the profiler measures and the solver places."""

    name: str
    """FQN of the block's module in the original model."""
    kind: str
    """``embedding``, ``decoder_layer``, ``norm``, ``head`` or ``block``."""
    class_name: str


@dataclass(frozen=True, slots=True)
class BlockChain:
    """The blocks of a model in execution order."""

    blocks: tuple[Block, ...]
    family: str
    """``hf_causal_lm`` for HF decoder LMs; ``sequential`` or ``modulelist`` otherwise."""
    tied_embeddings: bool
    """Input embedding and output head share one weight."""
    fingerprint: str
    layer_class_names: tuple[str, ...] = ()
    """Class names of the repeated layers (what NxD calls ``transformer_layer_cls``)."""
    shared_modules: tuple[str, ...] = ()
    """Parameter-free modules every stage needs (e.g. ``model.rotary_emb``)."""

    @property
    def names(self) -> list[str]:
        """Block FQNs in order."""
        return [b.name for b in self.blocks]


def discover_blocks(model: nn.Module, *, layer_classes: list[str] | None = None,
                    leaf_modules: list[str] | None = None) -> BlockChain:
    """Find the block chain of ``model``.

    ``layer_classes`` overrides the repeated-layer class names; ``leaf_modules``
    names classes never split (each instance outside the layers becomes one block).
    """
    hf = _hf_parts(model) if layer_classes is None else None
    if hf is not None:
        return hf
    if isinstance(model, nn.Sequential) and layer_classes is None:
        blocks = tuple(Block(name=n, kind="block", class_name=type(m).__name__)
                       for n, m in model.named_children())
        return _chain(model, blocks, "sequential", ())
    return _modulelist_chain(model, layer_classes, leaf_modules or [])


# --- HF causal LMs -----------------------------------------------------------------------------


def _hf_parts(model: nn.Module) -> BlockChain | None:
    no_split = getattr(model, "_no_split_modules", None)
    backbone = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if not no_split or backbone is None or head is None:
        return None
    layers = getattr(backbone, "layers", None)
    embed = getattr(backbone, "embed_tokens", None)
    norm = getattr(backbone, "norm", None)
    if not isinstance(layers, nn.ModuleList) or embed is None or norm is None:
        return None
    layer_cls = {type(m).__name__ for m in layers}
    if not layer_cls <= set(no_split):
        return None
    blocks = [Block("model.embed_tokens", "embedding", type(embed).__name__)]
    blocks += [Block(f"model.layers.{i}", "decoder_layer", type(m).__name__)
               for i, m in enumerate(layers)]
    blocks += [Block("model.norm", "norm", type(norm).__name__),
               Block("lm_head", "head", type(head).__name__)]
    shared = ("model.rotary_emb",) if hasattr(backbone, "rotary_emb") else ()
    return _chain(model, tuple(blocks), "hf_causal_lm", tuple(sorted(layer_cls)), shared)


# --- generic models ----------------------------------------------------------------------------


def _modulelist_chain(model: nn.Module, layer_classes: list[str] | None,
                      leaf_modules: list[str]) -> BlockChain:
    if layer_classes:
        layers = [n for n, m in model.named_modules() if type(m).__name__ in layer_classes]
        if not layers:
            raise ModelSourceError(f"no module of class {layer_classes} in "
                                   f"{type(model).__name__}; check --layer-class")
    else:
        lists = [(len(m), n) for n, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) > 0]
        if not lists:
            raise ModelSourceError(
                f"cannot find blocks in {type(model).__name__}: it is not an HF causal LM, "
                f"not nn.Sequential and has no ModuleList; pass --layer-class NAME")
        _, list_name = max(lists, key=lambda x: (x[0], -len(x[1])))
        _LOG.warning("%s: blocks are %s's %d layers plus the modules around them, taken as "
                     "a straight chain (each output feeds the next block); times and plans "
                     "are wrong if its forward does more between them", type(model).__name__,
                     list_name, len(model.get_submodule(list_name)))
        layers = [f"{list_name}.{i}" for i in range(len(model.get_submodule(list_name)))]
    layer_set = set(layers)
    blocks: list[Block] = []
    for fqn, module in _leaf_walk(model, "", layer_set, set(leaf_modules)):
        kind = "block"
        if fqn not in layer_set and isinstance(module, nn.Embedding) and not blocks:
            kind = "embedding"
        blocks.append(Block(fqn, kind, type(module).__name__))
    classes = tuple(sorted({b.class_name for b in blocks if b.name in layer_set}))
    return _chain(model, tuple(blocks), "modulelist", classes)


def _leaf_walk(module: nn.Module, prefix: str, layers: set[str], leaves: set[str]):
    """Yield (fqn, module) of layer blocks and of parameter-holding outer modules, in order."""
    for name, child in module.named_children():
        fqn = f"{prefix}{name}"
        if fqn in layers or type(child).__name__ in leaves:
            yield fqn, child
        elif any(layer.startswith(fqn + ".") for layer in layers):
            yield from _leaf_walk(child, fqn + ".", layers, leaves)
        elif any(True for _ in child.parameters()):
            yield fqn, child


def _chain(model: nn.Module, blocks: tuple[Block, ...], family: str,
           layer_classes: tuple[str, ...], shared: tuple[str, ...] = ()) -> BlockChain:
    if not blocks:
        raise ModelSourceError(f"{type(model).__name__} has no blocks with parameters")
    tied = _tied(model, blocks)
    return BlockChain(blocks=blocks, family=family, tied_embeddings=tied,
                      fingerprint=_fingerprint(model, blocks, tied),
                      layer_class_names=layer_classes, shared_modules=shared)


def _tied(model: nn.Module, blocks: tuple[Block, ...]) -> bool:
    """True when two different blocks own the same parameter object."""
    owner: dict[int, str] = {}
    for block in blocks:
        for p in model.get_submodule(block.name).parameters():
            if owner.setdefault(id(p), block.name) != block.name:
                return True
    return False


def _fingerprint(model: nn.Module, blocks: tuple[Block, ...], tied: bool) -> str:
    digest = hashlib.sha256(f"tied={tied}\n".encode())
    for block in blocks:
        digest.update(f"{block.name}|{block.kind}|{block.class_name}\n".encode())
        for pname, p in model.get_submodule(block.name).named_parameters(remove_duplicate=False):
            digest.update(f"  {pname}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return digest.hexdigest()[:16]

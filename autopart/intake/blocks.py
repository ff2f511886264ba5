"""Discover the ordered chain of blocks of a model by watching its own forward.

Candidate blocks are the repeated layers (the classes in an HF model's
``_no_split_modules``, the user's ``layer_classes``, or the largest ``ModuleList``
/ ``ModuleDict`` of one class) and the parameter-holding modules around them
(token and position embeddings, final norm, head); an ``nn.Sequential``'s
candidates are its children. ``autopart.intake.watch`` then runs the forward once
and keeps the candidates in the order they are called, with the arguments each
receives; candidates that no exact pipeline cut can separate are fused into one
block. No family's module names are written down here: they are what was seen.

At the ``half`` level each decoder layer's parameter-holding children become
candidates too, and the layer splits into its two halves where the trace proves the
cut between them exact (``autopart.intake.sublayer``); otherwise layers stay whole
and ``BlockChain.notes`` says why. At ``projection`` each half is cut before its output
projection too, where exact (``autopart.intake.inner``). A block that is part of a
module's call says so in ``Block.parts`` (``autopart.schema.parts``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace

import torch
from torch import nn

from autopart.errors import ModelSourceError
from autopart.intake.chain import Block, BlockChain
from autopart.intake.inner import split_inner
from autopart.intake.sources import fill_meta_buffers
from autopart.intake.sublayer import layer_children, split_halves
from autopart.intake.watch import ForwardTrace, trace_forward
from autopart.schema.parts import LEVEL_ALIASES

__all__ = ["DISCOVERY_LEVELS", "discover_blocks", "example_inputs", "with_carries"]

DISCOVERY_LEVELS = ("layer", "half", "projection")
"""The levels whose blocks intake finds in the forward (coarse to fine); ``slice`` parts
are derived from ``half`` blocks by the planner."""

_LOG = logging.getLogger(__name__)

TRACE_SEQ_LEN = 16
"""Sequence length of the forward autopart watches (structure only, not costs)."""


def discover_blocks(model: nn.Module, *, layer_classes: list[str] | None = None,
                    leaf_modules: list[str] | None = None,
                    granularity: str = "layer") -> BlockChain:
    """Find the block chain of ``model`` (on meta) by watching one forward.

    Args:
        model: the model, parameters on meta (buffers may be real).
        layer_classes: class names of the repeated layers, overriding discovery.
        leaf_modules: class names never split (each instance outside the layers
            becomes one candidate).
        granularity: the finest level to look for (``DISCOVERY_LEVELS``, schema 1 names
            too): ``layer`` (whole decoder layers), ``half`` (each layer as its attention
            half and its MLP half where a cut between them is exact; the chain says in
            ``notes`` why layers stay whole otherwise) or ``projection`` (each half split
            before its output projection too where that cut is exact,
            ``autopart.intake.inner``).

    Returns:
        The ``BlockChain``. Its fingerprint does not depend on the level.

    Raises:
        ModelSourceError: no candidate blocks, a forward autopart cannot pipeline, or
            an unknown level.
    """
    granularity = LEVEL_ALIASES.get(granularity, granularity)
    if granularity not in DISCOVERY_LEVELS:
        raise ModelSourceError(f"granularity {granularity!r} is not one of "
                               f"{', '.join(DISCOVERY_LEVELS)}")
    what = type(model).__name__
    if isinstance(model, nn.Sequential) and layer_classes is None:
        candidates = [n for n, _ in model.named_children()]
        layers: set[str] = set()
        family = "sequential"
    else:
        layers = set(_layers(model, layer_classes))
        candidates = [fqn for fqn, _ in _leaf_walk(model, "", layers, set(leaf_modules or []))]
        family = "hf_causal_lm" if _is_hf_causal_lm(model) else "traced"
    if not candidates:
        raise ModelSourceError(f"{what} has no blocks with parameters; pass --layer-class NAME")
    inside = tuple(c + "." for c in candidates)
    glue_meta = [b for b in fill_meta_buffers(model) if not b.startswith(inside)]
    if glue_meta:
        raise ModelSourceError(
            f"buffer {glue_meta[0]} of {what} is on the meta device but the forward reads it "
            f"between blocks; build the model with its buffers on the CPU (only parameters "
            f"may be on meta)")
    order, trace = _watch(model, candidates, what)
    if not trace.output_labelled:
        raise ModelSourceError(f"{what}'s output does not depend on the blocks autopart found "
                               f"({order[0]} .. {order[-1]}); pass --layer-class NAME")
    uncalled = [c for c in candidates if c not in order and _has_params(model.get_submodule(c))]
    if uncalled:
        _LOG.warning("%s: %s never run in the forward; they are left out of every stage",
                     what, ", ".join(uncalled[:3]))
    blocks = _fuse(model, order, trace, layers, family)
    classes = tuple(sorted({type(model.get_submodule(f)).__name__ for f in layers}))
    shared = tuple(_shared(model, {f for b in blocks for f in b.fqns}, layers))
    tied = _tied(model, blocks)
    chain = BlockChain(blocks=blocks, family=family, tied_embeddings=tied,
                       fingerprint=_fingerprint(model, blocks, tied),
                       layer_class_names=classes, shared_modules=shared, trace=trace)
    if granularity != "layer":
        chain = _split_layers(model, chain, layers, what)
    if granularity == "projection" and chain.granularity == "half":
        chain = split_inner(model, chain, lambda m, c, w: _watch(m, c, w, carry=True), what)
    return chain


def with_carries(model: nn.Module, chain: BlockChain) -> BlockChain:
    """``chain`` with ``trace.carries`` filled: what crosses each cut beside the next call's
    stream (``ForwardTrace.carries``), from a trace with ``carry=True`` over its calls.

    A cut inside a half's module ``P`` (``autopart.intake.slice_rules``) falls inside the
    half's block, so the residual crossing it rides along as the argument of an earlier
    call it is (the half's norm's input), as at a ``projection`` cut.
    """
    if chain.trace is None or chain.trace.carries:
        return chain
    order, traced = _watch(model, chain.call_fqns, type(model).__name__, carry=True)
    assert order == chain.call_fqns, (order, chain.call_fqns)  # the same forward, watched again
    return replace(chain, trace=replace(chain.trace, carries=traced.carries))


def _watch(model: nn.Module, candidates: list[str], what: str,
           carry: bool = False) -> tuple[list[str], ForwardTrace]:
    """Trace the forward on a tiny seeded input; the caller's random stream is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        example = example_inputs(model, candidates, 1, TRACE_SEQ_LEN)
        return trace_forward(model, candidates, example, what, carry=carry)


def _split_layers(model: nn.Module, chain: BlockChain, layers: set[str],
                  what: str) -> BlockChain:
    """``chain`` with each decoder layer split into halves, or with a note saying why not."""
    whole = [b.name for b in chain.blocks if b.name in layers]
    children, reason = layer_children(model, whole)
    blocks: tuple[Block, ...] = ()
    trace = None
    if not reason:
        candidates = [c for b in chain.blocks for f in b.fqns for c in children.get(f, [f])]
        try:
            order, trace = _watch(model, candidates, what)
        except ModelSourceError as exc:
            reason = str(exc)
        else:
            fused = _fuse(model, order, trace, layers, chain.family)
            blocks, reason = split_halves(fused, children)
    if reason:
        return replace(chain, notes=(f"decoder layers stay whole: {reason}",))
    shared = tuple(_shared(model, {f for b in blocks for f in b.fqns}, layers))
    return replace(chain, blocks=blocks, trace=trace, shared_modules=shared,
                   granularity="half")


def example_inputs(model: nn.Module, candidates: list[str], micro_batch_size: int,
                   seq_len: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[tuple, dict]:
    """Positional and keyword inputs of one microbatch for ``model``'s forward.

    HF causal LMs get token ids (and ``use_cache=False``); other models their
    ``autopart_example_input(micro_batch_size, seq_len)`` if they define one, else
    token ids when the first candidate holds an ``nn.Embedding``, else floats of
    shape ``[mbs, seq, in_features]`` with ``in_features`` the last dimension of its
    first parameter.
    """
    shape = (micro_batch_size, seq_len)
    if _is_hf_causal_lm(model):
        vocab = int(getattr(model.config, "vocab_size", 2) or 2)
        return (torch.randint(0, vocab, shape, device=device),), {"use_cache": False}
    example = getattr(model, "autopart_example_input", None)
    if callable(example):
        value = example(*shape)
        if not isinstance(value, torch.Tensor):
            raise ModelSourceError(f"autopart_example_input returned {type(value).__name__}, "
                                   f"expected one tensor")
        if value.is_meta:
            value = (torch.randn(value.shape) if value.is_floating_point()
                     else torch.zeros(value.shape, dtype=value.dtype))
        if value.is_floating_point():
            value = value.to(dtype)
        return (value.to(device),), {}
    first = model.get_submodule(candidates[0])
    embed = next((m for m in first.modules() if isinstance(m, nn.Embedding)), None)
    if embed is not None:
        return (torch.randint(0, embed.num_embeddings, shape, device=device),), {}
    param = next(first.parameters(), None)
    if param is None or param.dim() == 0:
        raise ModelSourceError(f"cannot infer the input of {type(model).__name__} (its first "
                               f"block {candidates[0]!r} has no weight to read a width from); "
                               f"define model.autopart_example_input(micro_batch_size, seq_len)")
    return (torch.randn(*shape, param.shape[-1], device=device, dtype=dtype),), {}


# --- candidates --------------------------------------------------------------------------------


def _is_hf_causal_lm(model: nn.Module) -> bool:
    """An HF model with an output embedding that names its layers (``_no_split_modules``)
    or is one of transformers' registered causal LMs (GPT-1, XLNet, RemBERT name none)."""
    config = getattr(model, "config", None)
    if (config is None or not hasattr(model, "get_output_embeddings")
            or model.get_output_embeddings() is None):
        return False
    if getattr(model, "_no_split_modules", None):
        return True
    return (type(model).__module__.startswith("transformers.")
            and type(model).__name__ in _registered_causal_lms())


def _registered_causal_lms() -> set[str]:
    """Class names of transformers' ``AutoModelForCausalLM`` registry."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def _layers(model: nn.Module, layer_classes: list[str] | None) -> list[str]:
    names = layer_classes or [c for c in getattr(model, "_no_split_modules", None) or []]
    if names:
        found = [n for n, m in model.named_modules() if type(m).__name__ in names]
        found = [n for n in found if not any(n.startswith(o + ".") for o in found)]
        if found or layer_classes:
            if not found:
                raise ModelSourceError(f"no module of class {layer_classes} in "
                                       f"{type(model).__name__}; check --layer-class")
            return found
    groups = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0:
            kinds = {type(m) for m in module.children()}
            if len(kinds) == 1:
                groups.append((len(module), -len(name), name, module))
    if not groups:
        raise ModelSourceError(
            f"cannot find repeated layers in {type(model).__name__}: no ModuleList or "
            f"ModuleDict of one layer class; pass --layer-class NAME")
    _, _, name, module = max(groups, key=lambda g: g[:3])
    prefix = f"{name}." if name else ""
    return [f"{prefix}{key}" for key, _ in module.named_children()]


def _leaf_walk(module: nn.Module, prefix: str, layers: set[str], leaves: set[str]):
    """Yield (fqn, module) of layers and of parameter-holding outer modules, in order."""
    for name, child in module.named_children():
        fqn = f"{prefix}{name}"
        if fqn in layers or type(child).__name__ in leaves:
            yield fqn, child
        elif any(layer.startswith(fqn + ".") for layer in layers):
            yield from _leaf_walk(child, fqn + ".", layers, leaves)
        elif _has_params(child):
            yield fqn, child


def _shared(model: nn.Module, owned: set[str], layers: set[str]):
    """Parameter-free modules beside the blocks (rotary tables, dropout): every stage runs them."""
    holders = {""} | {o.rsplit(".", i)[0] for o in owned | layers
                      for i in range(1, o.count(".") + 1)}
    for fqn, module in model.named_modules():
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        if (fqn and parent in holders and fqn not in owned and fqn not in holders
                and not _has_params(module)):
            yield fqn


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


# --- blocks ------------------------------------------------------------------------------------


def _fuse(model: nn.Module, order: list[str], trace: ForwardTrace, layers: set[str],
          family: str) -> tuple[Block, ...]:
    groups: list[list[int]] = [[0]]
    for k, safe in enumerate(trace.safe_cuts):
        if safe:
            groups.append([k + 1])
        else:
            groups[-1].append(k + 1)
    blocks = []
    for g, calls in enumerate(groups):
        fqns = tuple(order[i] for i in calls)
        modules = [model.get_submodule(f) for f in fqns]
        kind = _kind(fqns, modules, layers, first=g == 0, last=g == len(groups) - 1,
                     family=family)
        blocks.append(Block(name=fqns[-1], kind=kind, class_name=type(modules[-1]).__name__,
                            modules=fqns if len(fqns) > 1 else (), calls=tuple(calls)))
    return tuple(blocks)


def _kind(fqns: tuple[str, ...], modules: list[nn.Module], layers: set[str], *, first: bool,
          last: bool, family: str) -> str:
    """HF causal LMs: the four kinds; ``nn.Sequential``: ``block``; other models:
    ``embedding`` for a first block holding an ``nn.Embedding``, else ``block``."""
    if family == "sequential":
        return "block"
    hf = family == "hf_causal_lm"
    if first and any(isinstance(m, nn.Embedding) for mod in modules for m in mod.modules()):
        return "embedding"
    if not hf:
        return "block"
    if any(f in layers for f in fqns):
        return "decoder_layer"
    if last:
        return "head"
    if all("norm" in type(m).__name__.lower() for m in modules):
        return "norm"
    return "block"


def _tied(model: nn.Module, blocks: tuple[Block, ...]) -> bool:
    """True when two different blocks own the same parameter object."""
    owner: dict[int, str] = {}
    for block in blocks:
        for fqn in block.fqns:
            for p in model.get_submodule(fqn).parameters():
                if owner.setdefault(id(p), block.name) != block.name:
                    return True
    return False


def _fingerprint(model: nn.Module, blocks: tuple[Block, ...], tied: bool) -> str:
    digest = hashlib.sha256(f"tied={tied}\n".encode())
    for block in blocks:
        digest.update(f"{block.name}|{block.kind}|{block.class_name}\n".encode())
        for fqn in block.fqns:
            where = f"{fqn}." if block.modules else ""
            for pname, p in model.get_submodule(fqn).named_parameters(remove_duplicate=False):
                digest.update(f"  {where}{pname}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return digest.hexdigest()[:16]

"""Run a model's own forward while autopart decides what each block call does.

Every block module's ``forward`` is routed through a handler for the duration of
one model call (``intercept``). The profiler's handler materializes and measures
the block with exactly the arguments the model's forward gave it; a pipeline
stage's handler runs the blocks it owns, stands in for the blocks before it and
stops the forward at the first block after it (``StageExit``). The model's own
code between blocks (masks, rotary embeddings, scaling, residual glue) runs
unchanged, so no family's calling convention is written down here.

``StandIn`` is the stand-in: it runs a block on the meta device to learn the
shapes of its outputs and returns zeros of those shapes where the caller lives.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map_only, tree_unflatten

__all__ = ["KeepOffMeta", "StageExit", "Substitute", "intercept", "leaf_paths", "meta_copy",
           "meta_safe_experts", "StandIn", "model_output_tensor", "replace_leaves",
           "structure_key"]

Handler = Callable[[int, nn.Module, Callable[..., Any], tuple, dict], Any]


class StageExit(BaseException):
    """Raised by a stage's handler to end the model's forward early, carrying the stream.

    It derives from ``BaseException`` so that no ``except Exception`` in model code
    swallows it.
    """

    def __init__(self, value: Any) -> None:
        super().__init__("autopart stage exit")
        self.value = value


@contextlib.contextmanager
def intercept(model: nn.Module, fqns: Sequence[str], handler: Handler) -> Iterator[None]:
    """Route calls of the modules ``fqns`` of ``model`` to ``handler`` while inside.

    ``handler(idx, module, original_forward, args, kwargs)`` gets the index of the
    module in ``fqns``; its return value is what the model's forward sees. Hooks
    registered on the modules still run around it. Restores the modules on exit.
    """
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for idx, fqn in enumerate(fqns):
            module = model.get_submodule(fqn)
            before = module.__dict__.get("forward")
            original = module.forward

            def routed(*args: Any, _i: int = idx, _m: nn.Module = module,
                       _f: Callable[..., Any] = original, **kwargs: Any) -> Any:
                return handler(_i, _m, _f, args, kwargs)

            module.forward = routed
            patched.append((module, before))
        yield
    finally:
        for module, before in patched:
            if before is None:
                del module.forward
            else:
                module.forward = before


class KeepOffMeta(TorchFunctionMode):
    """Leave real tensors where they are when the model's code moves them to meta.

    Model code such as Llama 4's ``input_ids.to(self.embed_tokens.weight.device)``
    follows a parameter's device; with the parameters on meta (a block autopart
    measures or stands in for elsewhere) that would send the real glue values to meta,
    where nothing can be read back. Under this mode ``Tensor.to`` keeps a real
    tensor's device (the dtype still changes as asked).
    """

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Leave the mode while inside: for a block call on real weights, whose every
        torch call would otherwise pay for the mode (a fifth of a small model's forward
        on CPU), as the runtime's blocks do not (``Substitute.paused``)."""
        return _paused(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (getattr(func, "__name__", "") == "to" and isinstance(out, torch.Tensor)
                and out.is_meta and args and isinstance(args[0], torch.Tensor)
                and not args[0].is_meta):
            return args[0].to(dtype=out.dtype)
        return out


def leaf_paths(args: tuple, kwargs: dict) -> list[Any]:
    """The flattened leaves of ``(args, kwargs)`` (the order ``replace_leaves`` uses)."""
    return tree_flatten((args, kwargs))[0]


def replace_leaves(args: tuple, kwargs: dict, values: dict[int, Any]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the flattened leaves at the given indices replaced."""
    leaves, spec = tree_flatten((args, kwargs))
    for idx, value in values.items():
        leaves[idx] = value
    new_args, new_kwargs = tree_unflatten(leaves, spec)
    return tuple(new_args), dict(new_kwargs)


class Substitute(TorchFunctionMode):
    """Use a received tensor wherever the model's code uses the stand-in it replaces.

    A stage swaps received tensors into its first block's stream arguments. When the
    model's own code uses a stream value again later (``h = h + layer(h)``, or a
    ``memory`` passed to every layer), that later use must see the received tensor
    too: while this mode is active every torch call gets its arguments swapped by
    identity. ``swap`` does the same for the stage's own block calls.
    """

    def __init__(self) -> None:
        super().__init__()
        self.table: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._deferred = False
        self._entered = False

    def add(self, stand_in: torch.Tensor, received: torch.Tensor) -> None:
        """From now on, ``received`` is used wherever ``stand_in`` was (inside
        ``from_first_add``, the mode is entered now if it was not yet)."""
        self.table[id(stand_in)] = (stand_in, received)  # the stand-in is kept: ids stay unique
        if self._deferred and not self._entered:
            self._entered = True
            self.__enter__()

    @contextlib.contextmanager
    def from_first_add(self) -> Iterator[None]:
        """The mode for what runs inside, entered at the first ``add`` rather than here:
        until a received tensor replaces a stand-in there is nothing to swap, so the
        torch calls before it (a later stage's stand-ins and the model's code up to its
        first block, most of that stage's forward) do not pay for the mode. Left on
        exit, where every context entered inside has been left."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False
            if self._entered:
                self._entered = False
                self.__exit__(None, None, None)

    def swap(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with every stand-in replaced by its received tensor."""
        if not self.table or not self._may_hold(args, kwargs):
            return args, kwargs
        return tree_map_only(torch.Tensor, self._one, (args, kwargs))

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Leave the mode while inside: for a block whose arguments ``swap`` already
        replaced, so its own torch calls (most of a stage's) pay nothing for the mode.
        Does nothing when another torch-function mode is above this one."""
        return _paused(self)

    def _may_hold(self, args: tuple, kwargs: dict) -> bool:
        """Whether a stand-in may be among the arguments (in lists, tuples and dicts too;
        any other pytree container counts as maybe). Every torch call of the glue pays
        this check, so it walks the arguments without flattening them."""
        return _holds(args, self.table) or _holds(kwargs, self.table)

    def _one(self, t: torch.Tensor) -> torch.Tensor:
        hit = self.table.get(id(t))
        return t if hit is None or hit[0] is not t else hit[1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = self.swap(tuple(args), kwargs or {})
        return func(*args, **kwargs)


@contextlib.contextmanager
def _paused(mode: TorchFunctionMode) -> Iterator[None]:
    """Outside ``mode`` while inside, when it is the innermost torch-function mode (else
    nothing changes)."""
    if torch.overrides._get_current_function_mode() is not mode:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def _holds(x: Any, table: dict[int, Any]) -> bool:
    """Whether ``x`` is, or may contain, an object whose id is in ``table``."""
    if id(x) in table:
        return True
    if isinstance(x, (list, tuple)):
        return any(_holds(y, table) for y in x)
    if isinstance(x, dict):
        return any(_holds(y, table) for y in x.values())
    return type(x) in SUPPORTED_NODES


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_like(t, device="meta")


class StandIn:
    """Stand-in for a block: zeros shaped like its output, found by running it on meta.

    ``module`` is the block (any device); a meta copy of it is made and run only
    when the output shapes for these input shapes are not known yet. Stubs given the
    same ``shared`` dict share that knowledge between structurally identical blocks
    (same class, ``repr``, parameter and buffer shapes), so 48 equal decoder layers
    cost one meta run. A zero tensor with the shape and dtype of the first tensor
    argument is replaced by that argument itself (no allocation); values of
    stand-ins never reach an owned block (``autopart.intake.watch`` proves this for
    every allowed cut).
    """

    def __init__(self, module: nn.Module, shared: dict | None = None) -> None:
        self._source = module
        self._meta: nn.Module | None = None
        self._structure = structure_key(module)
        self._cache: dict[tuple, Any] = {} if shared is None else shared

    def prepare(self) -> StandIn:
        """Make the meta copy now, from the block as it is (before tensor parallelism or
        FSDP wrap it in place); returns ``self``."""
        if self._meta is None:
            self._meta = meta_copy(self._source)
        return self

    def __call__(self, args: tuple, kwargs: dict, device: torch.device) -> Any:
        """The stand-in output for a call with ``args`` and ``kwargs`` on ``device``."""
        leaves = leaf_paths(args, kwargs)
        key = (self._structure,) + tuple(
            (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
            for x in leaves)
        if key not in self._cache:
            if self._meta is None:
                self._meta = meta_copy(self._source)
            try:
                with torch.no_grad():
                    out = self._meta(*tree_map_only(torch.Tensor, _meta, args),
                                     **tree_map_only(torch.Tensor, _meta, kwargs))
            except Exception as exc:  # noqa: BLE001 - data-dependent code meta cannot run
                out = self._run_real(args, kwargs, exc)
            out_leaves, spec = tree_flatten(out)
            shapes = [(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None
                      for x in out_leaves]
            consts = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
            self._cache[key] = ((spec, consts), shapes)
        (spec, consts), shapes = self._cache[key]
        first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
        made = []
        for shape, const in zip(shapes, consts):
            if shape is None:
                made.append(const)
            elif first is not None and first.shape == shape[0] and first.dtype == shape[1]:
                made.append(first.detach())
            else:
                made.append(torch.zeros(shape[0], dtype=shape[1], device=device))
        return tree_unflatten(made, spec)


    def _run_real(self, args: tuple, kwargs: dict, meta_error: Exception) -> Any:
        """The block's output for these inputs from a real CPU copy with small random
        weights, where meta cannot run it: code whose shapes depend on values
        (JetMoE's attention experts read their token counts with ``tolist``, LongCat's
        router calls ``nonzero``) or that mixes its tensors with CPU ones. Only blocks
        of at most ``REAL_STAND_IN_BYTES`` of parameters are copied; a larger one
        raises the meta run's error."""
        size = sum(p.numel() * p.element_size() for p in self._source.parameters())
        if size > REAL_STAND_IN_BYTES:
            raise meta_error
        memo: dict[int, Any] = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for p in self._source.parameters():
                value = torch.empty(p.shape, dtype=p.dtype)
                if value.is_floating_point():
                    value.normal_(0.0, 0.02)
                else:
                    value.zero_()
                memo[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            for b in self._source.buffers():
                memo[id(b)] = (torch.zeros(b.shape, dtype=b.dtype) if b.is_meta
                               else b.detach().to("cpu", copy=True))
            real = copy.deepcopy(self._source, memo)
            for sub in real.modules():
                sub.__dict__.pop("forward", None)  # a routed forward copied from ``intercept``
            with torch.no_grad():
                return real(*tree_map_only(torch.Tensor, _on_cpu, args),
                            **tree_map_only(torch.Tensor, _on_cpu, kwargs))


REAL_STAND_IN_BYTES = 1 << 30
"""Largest block (parameter bytes) a stand-in copies onto the CPU to run for real."""


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU (zeros of its shape where it is on meta), outside autograd."""
    if t.is_meta:
        return torch.zeros(t.shape, dtype=t.dtype)
    return t.detach().to("cpu")


def structure_key(module: nn.Module) -> str:
    """Class, ``repr`` and parameter/buffer shapes of ``module``: equal keys, equal shapes out."""
    parts = [type(module).__qualname__, repr(module)]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()]
    return "\n".join(parts)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with parameters and buffers on meta (the original is untouched).

    HF mixture-of-experts layers are switched to their ``batched_mm`` experts kernel in
    the copy: the others route tokens with data-dependent shapes, which meta cannot run.
    """
    memo: dict[int, Any] = {}
    for p in module.parameters():  # a split (DTensor) parameter by its global shape
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    clone = copy.deepcopy(module, memo)
    for sub in clone.modules():
        sub.__dict__.pop("forward", None)  # a routed forward copied from inside ``intercept``
    meta_safe_experts(clone)
    return clone


def meta_safe_experts(module: nn.Module) -> None:
    """Switch HF MoE experts in ``module`` (a private copy) to a kernel meta can run.

    ``batched_mm`` runs every expert on every token, so FLOPs counted on meta are an
    upper bound for MoE layers.
    """
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "_experts_implementation_internal", None) not in (None, "batched_mm"):
            config._experts_implementation_internal = "batched_mm"


def model_output_tensor(output: Any) -> torch.Tensor:
    """The tensor a model's forward returns: ``logits`` of an HF output, else the first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if hasattr(output, "get") else None
    if isinstance(logits, torch.Tensor):
        return logits
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
    if not leaves and hasattr(output, "to_tuple"):
        leaves = [x for x in output.to_tuple() if isinstance(x, torch.Tensor)]
    if not leaves:
        raise TypeError(f"the model's forward returned {type(output).__name__} with no tensor")
    return leaves[0]

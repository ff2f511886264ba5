"""``profile_model``: per-block latency and memory of a model, one block at a time.

Blocks are materialized one at a time (``materialize``), fed by the previous
block's real output (``tasks``), measured or estimated by an engine
(``engines``). Blocks with identical structure and input (class, repr, parameter
shapes/dtypes, input shape, attention type) are measured once and reused
(``BlockProfile.reused_from``), so a 48-layer model costs about a 4-layer one.
The user's model is only read: parameters, buffers, ``requires_grad`` flags,
training flag and the global RNG state are left as they were.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopart.errors import AutopartError, ProfileError
from autopart.intake import BlockChain, LoadedModel, discover_blocks, load_model
from autopart.intake.chain import Block
from autopart.intake.forward import leaf_paths
from autopart.profile.analytical import flash_sdpa
from autopart.profile.engines import AnalyticalEngine, Figures, MeasuringEngine, make_engine
from autopart.profile.head_grad import head_split_fields
from autopart.profile.inner import (
    capture_call,
    minus_figures,
    stream_bytes,
    with_crossing_bytes,
)
from autopart.profile.materialize import materialize_block, param_bytes_and_count, weight_bytes
from autopart.profile.model_info import model_info
from autopart.profile.moe import expert_counter
from autopart.profile.neighbours import busy_neighbours
from autopart.profile.noise import load_average, recheck
from autopart.profile.options import ProfileOptions
from autopart.profile.order import OrderPass, order_pass
from autopart.profile.runner import ForwardRunner
from autopart.profile.slice_checks import SliceChecks
from autopart.profile.tasks import make_task
from autopart.profile.validate import TORCH_DTYPES, check_settings, check_shapes
from autopart.schema import BlockProfile, Profile, ProfileSetup

__all__ = ["profile_model"]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, str], None]
_Engine = MeasuringEngine | AnalyticalEngine


def profile_model(source: str | nn.Module | LoadedModel, options: ProfileOptions | None = None,
                  /, *, progress: ProgressFn | None = None, **fields: Any) -> Profile:
    """Profile every block of ``source`` for one microbatch of training.

    The blocks are found by watching the model's forward (``discover_blocks``);
    each is then measured with exactly the arguments that forward gives it.

    Args:
        source: Anything ``autopart.intake.load_model`` takes (preset, HF config
            path or directory, hub id in the local cache, ``pkg.module:factory``,
            an ``nn.Module``), or a ``LoadedModel``.
        options: How to measure (``ProfileOptions``: backend, shape, dtype, repeats, the
            finest level, neighbours); ``fields`` replace its fields, so
            ``profile_model("llama-3-8b", backend="analytical:h100")`` works alone. With
            ``neighbours`` on CPU, ``source`` must be a string
            (``autopart.profile.neighbours``).
        progress: ``progress(done, total, block_name)`` after each block.
        **fields: ``ProfileOptions`` fields.

    Returns:
        The ``Profile``: one ``BlockProfile`` per block, the set-up it was taken in. Where
        a family's layers or halves cannot be cut exactly they stay whole, and the
        profile's ``setup.granularity`` and notes say so.

    Raises:
        ModelSourceError: The model cannot be loaded or its forward not pipelined.
        ProfileError: Bad settings, a block failing on the backend, or neighbours that
            cannot start (one line).
    """
    opts = ProfileOptions.of(options, **fields)
    backend, dtype = opts.backend, opts.dtype
    micro_batch_size, seq_len = opts.micro_batch_size, opts.seq_len
    neighbours = opts.neighbours
    backend = check_settings(backend, micro_batch_size, seq_len, dtype, opts.num_warmup,
                             opts.num_repeats)
    if neighbours and backend != "cpu":
        raise ProfileError(f"busy neighbours are for the cpu backend (ranks sharing one CPU), "
                           f"not {backend}; profile with neighbours=0")
    if backend.startswith("analytical") and (opts.clock, opts.cache_flush) != ("auto", "auto"):
        raise ProfileError(f"--clock and --cache-flush choose how measured backends time "
                           f"blocks; {backend} estimates them: leave both at auto")
    settings = {**opts.as_fields(), "backend": backend, "neighbours": 0}
    layer_classes = list(opts.layer_classes) if opts.layer_classes else None
    leaf_modules = list(opts.leaf_modules) if opts.leaf_modules else None
    granularity, num_warmup, num_repeats = opts.granularity, opts.num_warmup, opts.num_repeats
    loaded = source if isinstance(source, LoadedModel) else load_model(source)
    model = loaded.model
    chain = discover_blocks(model, layer_classes=layer_classes, leaf_modules=leaf_modules,
                            granularity=granularity)
    check_shapes(loaded, chain, seq_len, backend, dtype)
    engine = make_engine(backend, dtype, num_warmup, num_repeats, opts.cache_flush,
                         opts.clock)
    torch_dtype = TORCH_DTYPES[dtype]
    if isinstance(engine, MeasuringEngine):
        engine.backend.size_flush(weight_bytes(model, torch_dtype))
    fork = [engine.device.index or 0] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):
        torch.manual_seed(0)
        runner = ForwardRunner(model, chain, engine.device, torch_dtype, micro_batch_size,
                               seq_len)
        if isinstance(engine, MeasuringEngine):
            engine.dtype = torch_dtype
        order = order_pass(model, chain, runner, engine, torch_dtype)
        if order is not None:
            # neighbours only load the machine: they skip the order passes, which would
            # hold a whole model each
            settings["cache_flush"] = "model"
        with busy_neighbours(source, neighbours, torch.get_num_threads(), settings,
                             profile_model):
            load_before = load_average()
            slices = SliceChecks(model, chain) if chain.granularity != "layer" else None
            blocks, outputs = _profile_blocks(model, chain, runner, engine, backend, dtype,
                                              progress, slices, order)
            timed_glue = (isinstance(engine, MeasuringEngine)
                          and engine.device.type in ("cpu", "cuda"))
            glue = runner.time_glue(outputs) if timed_glue else None
            if glue is not None:
                blocks = glue.onto(chain, blocks)
            info = model_info(loaded, chain, blocks, slices)
            head_split = (head_split_fields(
                tuple(model.get_submodule(chain.blocks[-1].name).weight.shape), dtype,
                micro_batch_size * max(seq_len - 1, 1), engine.device,
                engine.spec if isinstance(engine, AnalyticalEngine) else None)
                if info.head_split_rows else {})
            load_after = load_average()
    setup = ProfileSetup(
        backend=backend, device_name=engine.device_name, dtype=dtype,
        micro_batch_size=micro_batch_size, seq_len=seq_len, torch_version=torch.__version__,
        transformers_version=_transformers_version(),
        num_warmup=0 if backend.startswith("analytical") else num_warmup,
        num_repeats=0 if backend.startswith("analytical") else num_repeats,
        time_source=engine.time_source + (order.note if order is not None else "") + (
            f", beside {neighbours} busy neighbour process(es)" if neighbours else ""),
        memory_source=engine.memory_source,
        num_threads=torch.get_num_threads(),
        glue_fwd_ms=round(glue.total_ms, 4) if glue is not None else 0.0,
        **head_split,
        load_average=() if backend.startswith("analytical") else (load_before, load_after),
        neighbours=neighbours, device_memory_bytes=_device_memory_bytes(engine),
        attn_implementation=str(getattr(getattr(model, "config", None),
                                        "_attn_implementation", "") or ""),
        granularity=chain.granularity)
    return Profile(model=info, setup=setup, blocks=tuple(blocks))


def _device_memory_bytes(engine: _Engine) -> int:
    """The profiled device's memory (``ProfileSetup.device_memory_bytes``; 0: unknown)."""
    if isinstance(engine, AnalyticalEngine):
        return engine.spec.memory_bytes
    if engine.device.type == "cuda":
        return int(torch.cuda.get_device_properties(engine.device).total_memory)
    if engine.device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().total)
    return 0


def _profile_blocks(model: nn.Module, chain: BlockChain, runner: ForwardRunner,
                    engine: _Engine, backend: str, dtype: str,
                    progress: ProgressFn | None, slices: SliceChecks | None = None,
                    order: OrderPass | None = None
                    ) -> tuple[list[BlockProfile], dict[int, Any]]:
    """Watch the forward: measure each new kind of call, reuse identical ones; the blocks'
    profiles and every call's output (as the model's code saw it). With ``order``, the
    forwards are then scaled to their times in model order (``autopart.profile.order``)."""
    hf_init = getattr(model, "_init_weights", None) if chain.family == "hf_causal_lm" else None
    block_of = {c: b for b in chain.blocks for c in b.calls}
    seen: dict[str, tuple[_CallFigures, Any, int]] = {}
    done: dict[int, tuple[_CallFigures, str]] = {}
    contexts: dict[int, int] = {}
    outputs: dict[int, Any] = {}
    checked: set[str] = set()
    children: dict[str, tuple[_CallFigures, int]] = {}  # split P's key -> C's, stream bytes

    split = dict(chain.splits)  # projection: call of P -> call of C, measured inside P's visit
    sources = {c for cut in (chain.trace.carries if chain.trace else ()) for c in cut or ()}
    crossing: dict[Any, int] = {}  # (call, leaf) of carried values, call of C -> bytes

    def visit(idx: int, original: nn.Module, args: tuple, kwargs: dict) -> Any:
        block = block_of[idx]
        if slices is not None:
            slices.visit(idx, original, args, kwargs, lambda m: materialize_block(
                m, engine.device, TORCH_DTYPES[dtype], hf_init), engine.device)
        key = _signature(chain, idx, original, args, kwargs, contexts)
        for pos, leaf in enumerate(leaf_paths(args, kwargs)):
            if (idx, pos) in sources:
                crossing[(idx, pos)] = leaf.numel() * leaf.element_size()

        def measure() -> tuple[_CallFigures, Any]:
            figures, output, inner = _profile_call(chain, idx, block, original, args, kwargs,
                                                   runner, engine, hf_init, backend, dtype,
                                                   split.get(idx))
            if inner is not None:
                children[key] = inner
            return figures, output

        if key in seen and not _noisy(seen[key][0]):
            if key not in checked and isinstance(engine, MeasuringEngine):
                checked.add(key)  # reuse only what a second measurement confirms
                _recheck(seen, done, key, lambda: measure()[0])
            figures, output, _ = seen[key]
            done[idx] = (figures, key)
        else:
            figures, output = measure()
            # a disturbed twin is not reused: this call is measured and named for itself
            done[idx] = (figures, key if key not in seen else f"{key}#{idx}")
            seen.setdefault(key, (figures, output, idx))
            logger.info("profiled %s: fwd %.3f ms, bwd %.3f ms", chain.call_fqns[idx],
                        figures.figures.times.fwd_ms, figures.figures.times.bwd_ms)
        if idx in split:
            done[split[idx]] = (children[key][0], f"{done[idx][1]}#out")
            crossing[split[idx]] = children[key][1]
        if progress is not None and idx == block.calls[-1]:
            progress(chain.blocks.index(block) + 1, len(chain.blocks), block.name)
        outputs[idx] = output
        return output

    runner.run(visit)
    missing = [chain.call_fqns[i] for i in range(len(chain.call_fqns)) if i not in done]
    if missing:
        raise ProfileError(f"the forward did not call {missing[0]} when profiled, though it did "
                           f"when autopart watched it; the model's forward must call the same "
                           f"blocks for every input")
    if order is not None:
        done = order(done, split, outputs)
    first_of: dict[tuple[str, ...], str] = {}  # a block's call signatures -> first such block
    for block in chain.blocks:
        first_of.setdefault(tuple(done[c][1] for c in block.calls), block.name)
    profiles = [_block_profile(block, [done[c][0] for c in block.calls],
                               first_of[tuple(done[c][1] for c in block.calls)])
                for block in chain.blocks]
    return with_crossing_bytes(chain, profiles, crossing), outputs


@dataclass(frozen=True, slots=True)
class _CallFigures:
    figures: Figures
    param_bytes: int
    num_params: int
    expert_load: tuple[float, ...] = ()
    disagreed: bool = False
    """A re-measure of this call disagreed; these are the median of three."""


def _noisy(call: _CallFigures) -> bool:
    return call.figures.times.noisy or call.disagreed


def _recheck(seen: dict, done: dict, key: str, measure: Callable[[], _CallFigures]) -> None:
    """Measure a call about to be reused again (``noise.recheck``); on disagreement keep
    the median of three for it and for the calls that already took the first."""
    first, output, twin = seen[key]
    kept, disagreed = recheck(first, measure,
                              lambda c: c.figures.times.fwd_ms + c.figures.times.bwd_ms)
    if not disagreed:
        return
    kept = dataclasses.replace(kept, disagreed=True)
    logger.warning("re-measuring %s disagreed with its first measurement; kept the median "
                   "of three", key[:12])
    seen[key] = (kept, output, twin)
    for idx, (_, k) in list(done.items()):
        if k == key:
            done[idx] = (kept, key)


def _profile_call(chain: BlockChain, idx: int, block: Block, original: nn.Module, args: tuple,
                  kwargs: dict, runner: ForwardRunner, engine: _Engine,
                  hf_init: Callable[[nn.Module], None] | None, backend: str,
                  dtype: str, child: int | None = None
                  ) -> tuple[_CallFigures, Any, tuple[_CallFigures, int] | None]:
    """Materialize, measure and run one block call; its figures, its output for the model
    and, for a split half's module (``child``: the call of its output projection C), C's
    figures and stream bytes (the call's figures are then those of the part before C)."""
    fqn = chain.call_fqns[idx]
    rel = chain.call_fqns[child][len(fqn) + 1:] if child is not None else ""
    try:
        module = materialize_block(original, engine.device, TORCH_DTYPES[dtype], hf_init)
        task = make_task(chain, idx, module, args, kwargs, engine.device, runner.labels)
        figures: Figures = engine.measure(task, original)
        assert task.call is not None
        sdpa = flash_sdpa() if engine.device.type == "meta" else nullcontext()
        capture = capture_call(module, rel) if rel else nullcontext({})
        with torch.no_grad(), sdpa, expert_counter(module) as load, capture as seen:
            output = runner.to_glue(task.call())
        inner = None
        if rel:
            inner = _measure_child(chain, child, module, original, rel, seen["call"], runner,
                                   engine)
            figures = minus_figures(figures, inner[0].figures)
    except AutopartError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ProfileError(
            f"block {fqn} ({type(original).__name__}) failed on backend {backend} in {dtype}: "
            f"{type(exc).__name__}: {first}; try --dtype float32, check that the model runs "
            f"on this device, or pass --layer-class / autopart_example_input for custom "
            f"models") from exc
    param_bytes, num_params = param_bytes_and_count(module)
    if inner is not None:
        param_bytes -= inner[0].param_bytes
        num_params -= inner[0].num_params
    return _CallFigures(figures, param_bytes, num_params, tuple(load)), output, inner


def _measure_child(chain: BlockChain, child: int, module: nn.Module, original: nn.Module,
                   rel: str, call: tuple[tuple, dict], runner: ForwardRunner,
                   engine: _Engine) -> tuple[_CallFigures, int]:
    """The output projection C of a split half, and the bytes of its stream."""
    task = make_task(chain, child, module.get_submodule(rel), *call, engine.device,
                     runner.labels)
    figures = engine.measure(task, original.get_submodule(rel))
    param_bytes, num_params = param_bytes_and_count(module.get_submodule(rel))
    return (_CallFigures(figures, param_bytes, num_params),
            stream_bytes(chain.call(child).stream, *call))


def _block_profile(block: Block, calls: list[_CallFigures], twin: str) -> BlockProfile:
    """One block's profile from its calls (several when calls were fused); ``twin`` is the
    first block whose calls have the same signatures (its measurements are reused)."""
    figs = [c.figures for c in calls]
    t = [f.times for f in figs]
    m = [f.memory for f in figs]
    return BlockProfile(
        name=block.name, kind=block.kind, fwd_ms=sum(x.fwd_ms for x in t),
        bwd_ms=sum(x.bwd_ms for x in t), bwd_input_ms=sum(x.bwd_input_ms for x in t),
        bwd_weight_ms=sum(x.bwd_weight_ms for x in t),
        split_extra_ms=sum(x.split_extra_ms for x in t),
        param_bytes=sum(c.param_bytes for c in calls),
        activation_bytes=sum(x.activation_bytes for x in m), output_bytes=m[-1].output_bytes,
        transient_bytes=max(x.transient_bytes for x in m),
        adopted_grad_bytes=max(x.transient_bytes for x in m)
        - max(x.transient_bytes - x.adopted_grad_bytes for x in m),
        held_for_weight_bytes=sum(x.held_for_weight_bytes for x in m),
        num_params=sum(c.num_params for c in calls),
        fwd_ms_spread=max(x.fwd_ms_spread for x in t),
        bwd_ms_spread=max(x.bwd_ms_spread for x in t), measured=figs[0].measured,
        noisy=any(_noisy(c) for c in calls),
        num_measurements=max(x.num_measurements for x in t),
        compile_ms=sum(x.compile_ms for x in t), class_name=block.class_name,
        reused_from=twin if twin != block.name else None, modules=block.modules,
        parts=block.parts,
        expert_load=next((c.expert_load for c in calls if c.expert_load), ()))


def _signature(chain: BlockChain, idx: int, module: nn.Module, args: tuple, kwargs: dict,
               contexts: dict[int, int]) -> str:
    """Calls with equal signatures behave identically: measure once, reuse.

    Module structure (class, repr, parameter and buffer shapes), argument shapes and
    dtypes, which context tensors it gets (Gemma 3's sliding and global layers get
    different masks) and plain argument values; the last call also runs the loss.
    """
    digest = hashlib.sha256()
    last = idx == len(chain.call_fqns) - 1
    digest.update(f"{type(module).__qualname__}|last={last}\n{module!r}\n".encode())
    for name, p in module.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}\n".encode())
    for name, b in module.named_buffers():
        digest.update(f"{name}:{tuple(b.shape)}:{b.dtype}\n".encode())
    stream = chain.call(idx).stream
    for pos, leaf in enumerate(leaf_paths(args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            ctx = "s" if pos < len(stream) and stream[pos] >= 0 else \
                f"c{contexts.setdefault(id(leaf), len(contexts))}"
            digest.update(f"{ctx}:{tuple(leaf.shape)}:{leaf.dtype}\n".encode())
        else:
            digest.update(f"{leaf!r}"[:200].encode())
    return digest.hexdigest()


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return ""
    return transformers.__version__

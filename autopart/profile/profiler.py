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

import torch
from torch import nn

from autopart.errors import AutopartError, ProfileError
from autopart.intake import Block, BlockChain, LoadedModel, discover_blocks, load_model
from autopart.profile.analytical import flash_sdpa
from autopart.profile.engines import AnalyticalEngine, Figures, MeasuringEngine, make_engine
from autopart.profile.materialize import materialize_block, param_bytes_and_count
from autopart.profile.tasks import GenericRunner, HFRunner, make_runner
from autopart.profile.validate import TORCH_DTYPES, check_settings, check_shapes
from autopart.schema import BlockProfile, ModelInfo, Profile, ProfileSetup

__all__ = ["profile_model"]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, str], None]
_Runner = HFRunner | GenericRunner
_Engine = MeasuringEngine | AnalyticalEngine


def profile_model(source: str | nn.Module | LoadedModel, *, backend: str = "cpu",
                  micro_batch_size: int = 1, seq_len: int = 128, dtype: str = "float32",
                  num_warmup: int = 3, num_repeats: int = 10,
                  layer_classes: list[str] | None = None, leaf_modules: list[str] | None = None,
                  progress: ProgressFn | None = None) -> Profile:
    """Profile every block of ``source`` for one microbatch of training.

    ``source`` is anything ``autopart.intake.load_model`` takes, or a ``LoadedModel``.
    ``backend`` is ``cpu``, ``cuda``, ``xla`` or ``analytical:<device>`` (a key of
    ``profiles/devices.json``). ``progress(done, total, block_name)`` is called after
    each block. Raises ``ProfileError`` (one line, with a remedy) on bad settings.
    """
    backend = check_settings(backend, micro_batch_size, seq_len, dtype, num_warmup, num_repeats)
    loaded = source if isinstance(source, LoadedModel) else load_model(source)
    model = loaded.model
    chain = discover_blocks(model, layer_classes=layer_classes, leaf_modules=leaf_modules)
    check_shapes(loaded, chain, seq_len, backend, dtype)
    engine = make_engine(backend, dtype, num_warmup, num_repeats)
    torch_dtype = TORCH_DTYPES[dtype]
    fork = [engine.device.index or 0] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):
        torch.manual_seed(0)
        runner = make_runner(model, chain, engine.device, torch_dtype, micro_batch_size, seq_len)
        if isinstance(engine, MeasuringEngine) and not engine.backend.has_storages:
            engine.meta_runner = make_runner(model, chain, torch.device("meta"), torch_dtype,
                                             micro_batch_size, seq_len)
        blocks = _profile_blocks(model, chain, runner, engine, backend, dtype, progress)
    setup = ProfileSetup(
        backend=backend, device_name=engine.device_name, dtype=dtype,
        micro_batch_size=micro_batch_size, seq_len=seq_len, torch_version=torch.__version__,
        transformers_version=_transformers_version(),
        num_warmup=0 if backend.startswith("analytical") else num_warmup,
        num_repeats=0 if backend.startswith("analytical") else num_repeats,
        time_source=engine.time_source, memory_source=engine.memory_source,
        num_threads=torch.get_num_threads())
    return Profile(model=_model_info(loaded, chain), setup=setup, blocks=tuple(blocks))


def _profile_blocks(model: nn.Module, chain: BlockChain, runner: _Runner, engine: _Engine,
                    backend: str, dtype: str, progress: ProgressFn | None) -> list[BlockProfile]:
    """Walk the chain: measure each new block, reuse identical ones."""
    hf_init = getattr(model, "_init_weights", None) if chain.family == "hf_causal_lm" else None
    seen: dict[str, tuple[BlockProfile, torch.Tensor]] = {}
    inputs = runner.first_input()
    results: list[BlockProfile] = []
    for done, block in enumerate(chain.blocks, start=1):
        original = model.get_submodule(block.name)
        key = _signature(block, original, inputs, runner.signature_extra(block))
        if key in seen:
            twin, inputs = seen[key]
            results.append(dataclasses.replace(twin, name=block.name, reused_from=twin.name))
        else:
            profile, inputs = _profile_one(block, original, inputs, runner, engine, hf_init,
                                           backend, dtype)
            seen[key] = (profile, inputs)
            results.append(profile)
            logger.info("profiled %s: fwd %.3f ms, bwd %.3f ms", block.name, profile.fwd_ms,
                        profile.bwd_ms)
        if progress is not None:
            progress(done, len(chain.blocks), block.name)
    return results


def _profile_one(block: Block, original: nn.Module, inputs: torch.Tensor, runner: _Runner,
                 engine: _Engine, hf_init: Callable[[nn.Module], None] | None, backend: str,
                 dtype: str) -> tuple[BlockProfile, torch.Tensor]:
    """Materialize, measure and run one block; return its profile and its output."""
    try:
        module = materialize_block(original, engine.device, TORCH_DTYPES[dtype], hf_init)
        task = runner.task(block, module, inputs)
        figures: Figures = engine.measure(task, block, original)
        with torch.no_grad(), flash_sdpa() if engine.device.type == "meta" else nullcontext():
            output = task.forward().detach()
    except AutopartError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ProfileError(
            f"block {block.name} ({block.class_name}) failed on backend {backend} in {dtype}: "
            f"{type(exc).__name__}: {first}; try --dtype float32, check that the model runs "
            f"on this device, or pass --layer-class / autopart_example_input for custom "
            f"models") from exc
    param_bytes, num_params = param_bytes_and_count(module)
    t, m = figures.times, figures.memory
    profile = BlockProfile(
        name=block.name, kind=block.kind, fwd_ms=t.fwd_ms, bwd_ms=t.bwd_ms,
        bwd_input_ms=t.bwd_input_ms, bwd_weight_ms=t.bwd_weight_ms, param_bytes=param_bytes,
        activation_bytes=m.activation_bytes, output_bytes=m.output_bytes,
        transient_bytes=m.transient_bytes, num_params=num_params,
        fwd_ms_spread=t.fwd_ms_spread, bwd_ms_spread=t.bwd_ms_spread,
        measured=figures.measured, compile_ms=t.compile_ms, class_name=block.class_name)
    return profile, output


def _signature(block: Block, module: nn.Module, inputs: torch.Tensor, extra: str) -> str:
    """Blocks with equal signatures behave identically: measure once, reuse."""
    digest = hashlib.sha256()
    digest.update(f"{block.kind}|{type(module).__qualname__}|{extra}\n".encode())
    digest.update(f"{tuple(inputs.shape)}|{inputs.dtype}\n{module!r}\n".encode())
    for name, p in module.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}\n".encode())
    for name, b in module.named_buffers():
        digest.update(f"{name}:{tuple(b.shape)}:{b.dtype}\n".encode())
    return digest.hexdigest()


def _model_info(loaded: LoadedModel, chain: BlockChain) -> ModelInfo:
    config = loaded.config
    hf = chain.family == "hf_causal_lm" and config is not None
    num_layers = sum(1 for b in chain.blocks if b.kind == "decoder_layer")
    if not hf:
        num_layers = sum(1 for b in chain.blocks if b.class_name in chain.layer_class_names)
    return ModelInfo(
        name=loaded.name, fingerprint=chain.fingerprint,
        num_params=sum(p.numel() for p in loaded.model.parameters()), source=loaded.source,
        family=getattr(config, "model_type", chain.family) if hf else chain.family,
        tied_embeddings=chain.tied_embeddings,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0) if hf else 0,
        hidden_size=int(getattr(config, "hidden_size", 0) or 0) if hf else 0,
        num_layers=num_layers, layer_classes=chain.layer_class_names,
        shared_modules=chain.shared_modules)


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return ""
    return transformers.__version__

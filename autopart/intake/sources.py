"""Turn a model source into a model on the meta device.

Sources, tried in this order:
  * a module object (used as is; must already be on meta or CPU),
  * ``package.module:factory`` (called with parameters created on meta),
  * a path to an HF ``config.json`` or to a model directory holding one,
  * a built-in preset name (``profiles/presets/<name>.json``),
  * an HF hub id (``org/name``) resolved from the local HF cache only.
Nothing of full size is ever allocated.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopart._data import data_path
from autopart.errors import ModelSourceError
from autopart.intake.storage import params_on_meta

__all__ = ["LoadedModel", "build_hf_model", "list_presets", "load_model", "move_outside_blocks"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model on the meta device and where it came from."""

    model: nn.Module
    name: str
    source: str
    config: Any | None = None
    """The HF ``PretrainedConfig`` for HF models, else ``None``."""


def list_presets() -> list[str]:
    """Names of the built-in model presets."""
    root = data_path("presets")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_model(source: str | nn.Module, *, name: str | None = None) -> LoadedModel:
    """Build the model named by ``source`` on the meta device (see the module docstring)."""
    if isinstance(source, nn.Module):
        return LoadedModel(model=source, name=name or type(source).__name__,
                           source=type(source).__name__, config=getattr(source, "config", None))
    if not isinstance(source, str) or not source:
        raise ModelSourceError(f"model source must be a non-empty string or nn.Module, "
                               f"got {source!r}")
    if ":" in source and not os.path.exists(source):
        return _from_factory(source, name)
    path = Path(source).expanduser()
    if path.exists() or source.endswith(".json") or source.startswith((".", "/", "~")):
        config = load_hf_config(path)
        return LoadedModel(model=build_hf_model(config), name=name or _config_name(config, path),
                           source=str(path), config=config)
    if source in list_presets():
        config = _preset_config(source)
        return LoadedModel(model=build_hf_model(config), name=name or source,
                           source=f"preset:{source}", config=config)
    if _looks_like_hub_id(source):
        config = _hub_config(source)
        return LoadedModel(model=build_hf_model(config), name=name or source,
                           source=f"hub:{source}", config=config)
    raise ModelSourceError(
        f"unknown model {source!r}: not a preset ({', '.join(list_presets())}), an existing "
        f"path, a cached hub id (org/name) or package.module:factory; pick a preset or give "
        f"a path to an HF config.json"
    )


def load_hf_config(path: Path) -> Any:
    """Read an HF config from ``config.json`` or a directory holding one."""
    from transformers import AutoConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ModelSourceError(f"config path {path} does not exist (looked for {file}); "
                               f"give a path to an HF config.json or a model directory")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                               f"fix the file or use a preset") from None
    return _config_from_dict(data, str(file), AutoConfig)


def build_hf_model(config: Any) -> nn.Module:
    """Instantiate an HF causal LM for ``config``: parameters on meta, buffers on the CPU.

    Attention runs through SDPA where the family supports it, else eager attention
    (``config._attn_implementation`` says which). Buffers (rotary tables) are built
    for real because the model's own code between blocks reads them on every stage.

    Raises:
        ModelSourceError: transformers or torch rejects the config (one line).
    """
    from transformers import AutoModelForCausalLM

    _refuse_non_causal(config)
    try:  # initializing meta weights does nothing but costs time (0.5 s at 48 layers)
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        no_init_weights = contextlib.nullcontext
    for attn in ("sdpa", "eager"):
        config._attn_implementation = attn
        try:
            with params_on_meta(), no_init_weights():
                model = AutoModelForCausalLM.from_config(config)
            model.tie_weights()  # part of the init_weights skipped above
            return model
        except Exception as exc:  # noqa: BLE001 - any rejection of the config is one line
            if attn == "sdpa" and "scaled_dot_product_attention" in str(exc):
                logger.info("%s has no SDPA attention in transformers; using eager attention",
                            config.model_type)
                continue
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ModelSourceError(
                f"transformers cannot build a causal LM for model_type {config.model_type!r} "
                f"({type(exc).__name__}: {first}); fix the config (e.g. pad_token_id within "
                f"vocab_size) or use a package.module:factory") from None
    raise AssertionError("unreachable")  # pragma: no cover


def fill_meta_buffers(model: nn.Module) -> list[str]:
    """Give an HF model built entirely on meta the real buffers a fresh build computes.

    Rotary tables and similar buffers are computed in ``__init__`` from the config,
    and the model's code between blocks reads them on every stage, so a model built
    under ``torch.device("meta")`` gets them from a skeleton built with
    ``params_on_meta`` (no weight is allocated). Other models are left as they are.

    Returns:
        FQNs of the buffers still on meta.
    """
    missing = [n for n, b in model.named_buffers() if b.is_meta]
    config = getattr(model, "config", None)
    if missing and config is not None:
        try:
            with params_on_meta(), torch.device("cpu"):
                fresh = dict(type(model)(copy.deepcopy(config)).named_buffers())
        except Exception:  # noqa: BLE001 - a model class that cannot be rebuilt keeps its meta
            fresh = {}
        for fqn in list(missing):
            value = fresh.get(fqn)
            if value is not None and not value.is_meta:
                owner, _, leaf = fqn.rpartition(".")
                module = model.get_submodule(owner)
                if tuple(module._buffers[leaf].shape) == tuple(value.shape):
                    module._buffers[leaf] = value
                    missing.remove(fqn)
    return missing


def move_outside_blocks(model: nn.Module, block_fqns: list[str], device: torch.device) -> None:
    """Move the buffers that live outside every block (rotary tables) to ``device``."""
    blocks = tuple(f + "." for f in block_fqns)
    for fqn, module in model.named_modules():
        if fqn in block_fqns or (fqn + ".").startswith(blocks):
            continue
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta:
                module._buffers[name] = buf.to(device)


# --- private helpers ---------------------------------------------------------------------------


def _refuse_non_causal(config: Any) -> None:
    """One line for configs transformers has no causal LM for (encoder-only types such as
    BERT without a decoder head, encoder-decoder types such as T5)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelSourceError(
            f"model_type {model_type!r} is an encoder-decoder model; autopart pipelines "
            f"decoder-only causal LMs (transformers' AutoModelForCausalLM types)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSourceError(
            f"model_type {model_type!r} has no causal LM in transformers (an encoder-only or "
            f"other non-causal type); autopart pipelines decoder-only causal LMs")
    head = _encoder_head(config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if head:
        raise ModelSourceError(
            f"model_type {model_type!r} is an encoder: {head} attends in both directions "
            f"unless the config sets is_decoder=True; autopart pipelines decoder-only causal "
            f"LMs (set is_decoder=True for a causal decoder)")


def _encoder_head(config: Any, class_name: Any) -> str:
    """The causal-LM class name when ``config`` is an encoder's with ``is_decoder`` off and
    that class asks for ``is_decoder=True`` to be causal (BERT, RoBERTa, ELECTRA, ...:
    transformers warns "add `is_decoder=True`" when it builds one), else ``""``."""
    import inspect

    import transformers

    if getattr(config, "is_decoder", True) or not isinstance(class_name, str):
        return ""
    cls = getattr(transformers, class_name, None)
    try:
        source = inspect.getsource(cls.__init__) if cls is not None else ""
    except (OSError, TypeError):  # no source shipped: not decidable, let it through
        return ""
    return class_name if "is_decoder=True" in source else ""


def _config_from_dict(data: Any, where: str, auto_config: Any) -> Any:
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelSourceError(f"{where} has no 'model_type'; it is not an HF model config")
    model_type = data.pop("model_type")
    try:
        return auto_config.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise ModelSourceError(f"{where}: transformers does not know model_type "
                               f"{model_type!r} ({exc}); upgrade transformers or use a "
                               f"package.module:factory") from None


def _preset_config(preset: str) -> Any:
    from transformers import AutoConfig

    text = data_path("presets", f"{preset}.json").read_text()
    return _config_from_dict(json.loads(text), f"preset {preset}", AutoConfig)


def _config_name(config: Any, path: Path) -> str:
    if getattr(config, "name_or_path", ""):
        return config.name_or_path
    if path.is_dir():
        return path.resolve().name
    return path.resolve().parent.name if path.name == "config.json" else path.stem


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))


def _hub_config(repo_id: str) -> Any:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        try_to_load_from_cache = None
    cached = try_to_load_from_cache(repo_id, "config.json") if try_to_load_from_cache else None
    if not isinstance(cached, str):
        raise ModelSourceError(
            f"hub id {repo_id!r} is not in the local HF cache and autopart does not download; "
            f"pass a path to its config.json (or a directory holding it) instead"
        )
    return load_hf_config(Path(cached))


def _from_factory(spec: str, name: str | None) -> LoadedModel:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does: factories next to the user
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelSourceError(f"cannot import factory {spec!r} ({exc}); give "
                               f"package.module:function importable from this directory") from None
    try:
        with params_on_meta():
            model = factory()
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported as one line
        raise ModelSourceError(f"factory {spec!r} raised {type(exc).__name__}: {exc}; "
                               f"fix the factory so it returns an nn.Module") from None
    if not isinstance(model, nn.Module):
        raise ModelSourceError(f"factory {spec!r} returned {type(model).__name__}, "
                               f"expected an nn.Module")
    return LoadedModel(model=model, name=name or attr, source=spec,
                       config=getattr(model, "config", None))

"""Validation of profiling settings: one-line ``ProfileError`` with the value and a remedy."""

from __future__ import annotations

import torch

from autopart.errors import ProfileError
from autopart.intake import BlockChain, LoadedModel
from autopart.profile.devices import load_device_spec, parse_backend

__all__ = []

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_settings(backend: str, micro_batch_size: int, seq_len: int, dtype: str,
                   num_warmup: int, num_repeats: int) -> str:
    """Check the settings that need no model; return the normalized backend string."""
    name = parse_backend(backend)
    backend = str(name)
    if name.device is not None:
        spec = load_device_spec(name.device)
        if dtype in TORCH_DTYPES and dtype not in spec.peak_flops:
            raise ProfileError(f"device {spec.key} has no peak FLOP/s for dtype {dtype}; "
                               f"use one of {sorted(spec.peak_flops)}")
    if dtype not in TORCH_DTYPES:
        raise ProfileError(f"unsupported dtype {dtype!r}; use one of {', '.join(TORCH_DTYPES)}")
    _check_int("micro_batch_size", micro_batch_size, 1, "--micro-batch-size")
    _check_int("seq_len", seq_len, 1, "--seq-len")
    _check_int("num_repeats", num_repeats, 1, "--repeats")
    _check_int("num_warmup", num_warmup, 0, "--warmup")
    if backend == "xla" and num_warmup < 1:
        raise ProfileError("backend xla needs num_warmup >= 1 (got 0) so that compilation "
                           "stays outside the timed region; pass --warmup 1 or more")
    if backend == "cpu" and dtype == "float16":
        _probe_cpu_float16()
    return backend


def check_shapes(loaded: LoadedModel, chain: BlockChain, seq_len: int, backend: str,
                 dtype: str) -> None:
    """Check the settings against the model (sequence length vs. positions)."""
    config = loaded.config
    max_pos = getattr(config, "max_position_embeddings", None) if config is not None else None
    if chain.family == "hf_causal_lm":
        if seq_len < 2:
            raise ProfileError(f"seq_len {seq_len} is too short for a next-token loss; "
                               f"use --seq-len 2 or more")
        if isinstance(max_pos, int) and 0 < max_pos < seq_len:  # -1: no limit (XLNet)
            raise ProfileError(f"seq_len {seq_len} exceeds {loaded.name}'s "
                               f"max_position_embeddings ({max_pos}); lower --seq-len")


def _check_int(name: str, value: object, minimum: int, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProfileError(f"{name} must be an integer >= {minimum}, got {value!r}; "
                           f"fix {flag}")


def _probe_cpu_float16() -> None:
    """float16 matmul + backward on this CPU, or a ProfileError."""
    try:
        a = torch.randn(8, 8, dtype=torch.float16, requires_grad=True)
        (a @ a).sum().backward()
    except RuntimeError as exc:
        raise ProfileError(f"float16 does not run on this CPU with torch {torch.__version__} "
                           f"({str(exc).splitlines()[0]}); use --dtype bfloat16 or "
                           f"float32") from None

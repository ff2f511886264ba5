"""Analytical profiles of one tensor-parallel shard, for the mesh search.

A Megatron TP shard of a decoder layer is the same layer with ``1 / tp`` of the
attention heads (query and key-value) and of the MLP's intermediate size; the
vocabulary-parallel embedding and head hold ``1 / tp`` of the vocabulary. So the
analytical backend estimates a shard exactly by profiling the model's HF config with
those four sizes divided by ``tp`` (the hidden size stays whole, as the residual
stream does). Measured profiles have no such shortcut: ``autopart.cost.mesh`` scales
their times instead.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from autopart._data import data_path
from autopart.profile.devices import parse_backend
from autopart.schema import Profile

__all__ = ["profile_tp_shard"]

_DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def shard_config(config: dict, tp: int) -> dict:
    """An HF config with heads, key-value heads, intermediate size and vocabulary / tp.

    Key-value heads fewer than ``tp`` are replicated, as Megatron does (one per shard);
    sizes not divisible by ``tp`` round up (the largest shard).

    Args:
        config: The HF config as a dict.
        tp: Tensor-parallel degree.

    Returns:
        A new dict; ``head_dim`` is pinned so the per-head width does not change, and
        the special token ids are dropped (they may lie past the shard's vocabulary).
    """
    out = dict(config)
    if "head_dim" not in out and "hidden_size" in out and "num_attention_heads" in out:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    for key in _DIVIDED:
        if isinstance(out.get(key), int):
            out[key] = max(1, -(-out[key] // tp))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        out.pop(key, None)  # token ids past the shard's vocabulary only draw warnings
    return out


def profile_tp_shard(profile: Profile, tp: int) -> Profile | None:
    """The analytical profile of one TP shard of ``profile``'s model.

    Args:
        profile: An analytical profile of an HF model from a preset or a config path (the
            shard is profiled at its level).
        tp: Tensor-parallel degree.

    Returns:
        The shard's profile (same blocks in the same order), or ``None`` when
        ``profile`` is measured, its source is not an HF config autopart can reread, or
        the shard's block chain differs (then the caller scales instead).
    """
    if parse_backend(profile.setup.backend).kind != "analytical":
        return None
    config = _read_config(profile.model.source)
    if config is None:
        return None
    from autopart.profile.profiler import profile_model  # torch: only when a shard is made

    setup = profile.setup
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(shard_config(config, tp)))
        shard = profile_model(str(path), backend=setup.backend, seq_len=setup.seq_len,
                              micro_batch_size=setup.micro_batch_size, dtype=setup.dtype,
                              granularity=setup.granularity)
    same = [(b.kind, b.name) for b in shard.blocks] == [(b.kind, b.name) for b in profile.blocks]
    return shard if same else None


def _read_config(source: str) -> dict | None:
    if source.startswith("preset:"):
        path = data_path("presets", f"{source.removeprefix('preset:')}.json")
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

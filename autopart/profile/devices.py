"""Backend names (``cpu``, ``cuda``, ``xla``, ``analytical:<device>``) and the device
specifications of the analytical backend (``profiles/devices.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from autopart._data import data_path
from autopart.errors import ProfileError

__all__ = ["DeviceSpec", "list_devices", "load_device_spec", "parse_backend"]

BACKENDS = ("cpu", "cuda", "xla")
"""The measuring backends; ``analytical:<device>`` estimates instead."""

_REQUIRED = ("name", "peak_flops", "memory_bandwidth_bytes_per_s", "memory_bytes",
             "link_bandwidth_bytes_per_s", "link_latency_ms", "source")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One interconnect as a collective sees it, per device and direction."""

    bandwidth_bytes_per_s: float
    latency_ms: float
    """Cost of one step of a ring collective."""
    source: str = ""
    """Where the bandwidth comes from (datasheet URL)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """Peak figures of one accelerator (one pipeline rank), with where they come from."""

    key: str
    """Short name used on the command line (``h100``, ``trn2``...)."""
    name: str
    """Vendor's full product name."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype name (``float32``, ``bfloat16``, ``float16``)."""
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    link_bandwidth_bytes_per_s: float
    """Point-to-point bandwidth to the next pipeline rank, one direction."""
    link_latency_ms: float
    source: str
    """URL of the vendor datasheet the figures come from."""
    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s reached by real kernels."""
    memory_efficiency: float = 0.8
    """Fraction of peak memory bandwidth reached by real kernels."""
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    node_size: int = 1
    """Devices per node: tensor parallelism stays within one."""
    intra_node: LinkSpec | None = None
    """The link between devices of one node (NVLink/NVSwitch, NeuronLink)."""
    inter_node: LinkSpec | None = None
    """The link between nodes, per device (InfiniBand, EFA)."""

    def op_time_s(self, flops: float, num_bytes: float, dtype: str) -> float:
        """Roofline time of one op: ``max(flops / (peak * eff), bytes / (bandwidth * eff))``."""
        peak = self.peak_flops[dtype] * self.compute_efficiency
        bandwidth = self.memory_bandwidth_bytes_per_s * self.memory_efficiency
        return max(flops / peak, num_bytes / bandwidth)


@dataclass(frozen=True, slots=True)
class BackendName:
    """A parsed backend string."""

    kind: str
    """``cpu``, ``cuda``, ``xla`` or ``analytical``."""
    device: str | None = None
    """The device-spec key of an ``analytical`` backend (``h100``, ...); else ``None``."""

    def __str__(self) -> str:
        return f"analytical:{self.device}" if self.kind == "analytical" else self.kind


def parse_backend(text: str) -> BackendName:
    """Parse a backend string, the one place that reads ``analytical:<device>``.

    Args:
        text: ``cpu``, ``cuda``, ``xla`` or ``analytical:<device>`` (any case and
            surrounding spaces).

    Returns:
        The backend, with the analytical device's spec key normalized.

    Raises:
        ProfileError: Not a string, an unknown backend, ``analytical`` without a
            device, or a device not in ``profiles/devices.json``.
    """
    if not isinstance(text, str):
        raise ProfileError(f"backend must be a string, got {text!r}")
    kind, sep, device = text.strip().lower().partition(":")
    if kind == "analytical":
        if not device:
            raise ProfileError("backend 'analytical' needs a device: use analytical:<device>, "
                               "e.g. analytical:h100 (see profiles/devices.json)")
        return BackendName("analytical", load_device_spec(device).key)
    if sep or kind not in BACKENDS:
        raise ProfileError(f"unknown backend {text!r}; expected one of "
                           f"{', '.join(BACKENDS)}, analytical:<device>")
    return BackendName(kind)


def list_devices() -> list[str]:
    """Keys of the devices in ``profiles/devices.json``."""
    return sorted(_read()["devices"])


def load_device_spec(name: str) -> DeviceSpec:
    """The spec of device ``name`` (case-insensitive); ``ProfileError`` if unknown."""
    data = _read()
    key = name.strip().lower()
    devices = data["devices"]
    if key not in devices:
        raise ProfileError(f"unknown device {name!r} for the analytical backend; known devices: "
                           f"{', '.join(sorted(devices))} (e.g. --backend analytical:h100)")
    entry = devices[key]
    missing = [k for k in _REQUIRED if k not in entry]
    if missing:
        raise ProfileError(f"profiles/devices.json: device {key!r} lacks {missing}; "
                           f"add them with their datasheet source")
    defaults = data.get("default_efficiency", {})
    eff = {**defaults, **entry.get("efficiency", {})}
    return DeviceSpec(
        key=key, name=entry["name"],
        peak_flops={k: float(v) for k, v in entry["peak_flops"].items()},
        memory_bandwidth_bytes_per_s=float(entry["memory_bandwidth_bytes_per_s"]),
        memory_bytes=int(entry["memory_bytes"]),
        link_bandwidth_bytes_per_s=float(entry["link_bandwidth_bytes_per_s"]),
        link_latency_ms=float(entry["link_latency_ms"]),
        source=entry["source"],
        compute_efficiency=float(eff.get("compute", 0.6)),
        memory_efficiency=float(eff.get("memory", 0.8)),
        notes=entry.get("notes", ""),
        node_size=int(entry.get("node_size", 1)),
        intra_node=_link(entry.get("intra_node")),
        inter_node=_link(entry.get("inter_node")),
    )


def _link(entry: dict[str, Any] | None) -> LinkSpec | None:
    if entry is None:
        return None
    return LinkSpec(bandwidth_bytes_per_s=float(entry["bandwidth_bytes_per_s"]),
                    latency_ms=float(entry["latency_ms"]), source=entry.get("source", ""))


def _read() -> dict[str, Any]:
    text = data_path("devices.json").read_text()
    return json.loads(text)

"""Profile: per-block latency and memory on a backend (cpu, cuda, xla) or estimated
(``analytical:<device>``), one materialized block at a time."""

from autopart.profile.devices import DeviceSpec, list_devices, load_device_spec
from autopart.profile.profiler import profile_model

__all__ = ["DeviceSpec", "list_devices", "load_device_spec", "profile_model"]

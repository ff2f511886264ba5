"""Profile: per-block latency and memory for one microbatch of training.

``profile_model(source, backend=...)`` returns a ``Profile``. What each backend
measures (listed per block in ``BlockProfile.measured``) and what it estimates:

============  ==========================================  ===============================
backend       times (fwd, bwd, B, W)                       memory (activation, output,
                                                           transient)
============  ==========================================  ===============================
cpu           measured, ``time.perf_counter``              measured: saved-tensor hooks,
                                                           live-tensor dispatch mode
cuda          measured, CUDA events                        activations: saved-tensor hooks;
                                                           transient: allocator peak
xla           measured, ``mark_step`` + ``wait_device_ops``  computed on meta (activations
              (compilation excluded, in ``compile_ms``)     from ``xm.get_memory_info``
                                                           where it reports bytes in use)
analytical:D  estimated: roofline per op with the spec     computed on meta
              of device D (``profiles/devices.json``)
============  ==========================================  ===============================

W is always ``bwd_ms - bwd_input_ms`` (see ``autopart.profile.measure``); attention
on meta is counted as flash attention (see ``autopart.profile.analytical``). Two
memory figures for the schedule's timeline: ``held_for_weight_bytes`` (what torch's
split B keeps for W, on every backend, on meta where no storage is real) and
``adopted_grad_bytes`` (the weight gradients in the workspace, from the live-tensor
log on every backend; on cuda beside the allocator's workspace: on an H200, 50 of a
1B Llama's 67 blocks had some, 1141 MiB in all).
"""

from typing import Any

from autopart.profile.devices import DeviceSpec, list_devices, load_device_spec, parse_backend
from autopart.profile.options import ProfileOptions

# Public entry points of the profile phase.
__all__ = ["DeviceSpec", "ProfileOptions", "list_devices", "load_device_spec", "parse_backend",
           "profile_model"]


def __getattr__(name: str) -> Any:
    """Import the profiler (and torch) only when it is used: planning needs neither."""
    if name == "profile_model":
        from autopart.profile.profiler import profile_model

        return profile_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

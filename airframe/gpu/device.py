"""The WebGPU adapter and device airframe runs on.

`get_context()` picks the high-performance adapter (or the one named by AIRFRAME_ADAPTER), asks for
every limit the adapter offers (buffer size, storage binding size, workgroup storage) and for the
optional features we use when present (`shader-f16`, `subgroup`, `timestamp-query`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import GPUError

# Mesa's Vulkan loader prints "error: XDG_RUNTIME_DIR is invalid" when the variable is unset (a
# headless server, CI); compute needs no display, so give it a harmless value before wgpu loads.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

OPTIONAL_FEATURES = ("shader-f16", "subgroup", "timestamp-query", "timestamp-query-inside-passes", "immediates")
# the limits we raise to the adapter's maximum; the others keep WebGPU's defaults
WANTED_LIMITS = (
    "max-buffer-size",
    "max-storage-buffer-binding-size",
    "max-compute-workgroup-storage-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroups-per-dimension",
    "max-uniform-buffer-binding-size",
    "max-bind-groups",
    "max-immediate-size",
)
NO_ADAPTER_HELP = ("no WebGPU adapter found, expected at least one Vulkan, Metal or D3D12 device; "
                   "on Linux without a GPU install the CPU Vulkan driver lavapipe: "
                   "`apt-get install mesa-vulkan-drivers`")


@dataclass
class GPUContext:
    adapter: object
    device: object
    limits: dict
    features: set = field(default_factory=set)

    @property
    def has_f16(self) -> bool:
        return "shader-f16" in self.features

    @property
    def has_subgroups(self) -> bool:
        return "subgroup" in self.features

    @property
    def min_subgroup_size(self) -> int:
        """The fewest lanes a subgroup of this adapter may have (wgpu-py 0.32 spells the key
        "stackgroup_min_size"); 4, WebGPU's least, where the adapter does not say."""
        info = self.adapter.info
        return int(info.get("subgroup_min_size") or info.get("stackgroup_min_size") or 4)

    @property
    def has_timestamps(self) -> bool:
        return "timestamp-query" in self.features

    @property
    def name(self) -> str:
        return adapter_name(self.adapter)

    @property
    def max_binding(self) -> int:
        return int(self.limits["max-storage-buffer-binding-size"])

    @property
    def max_buffer(self) -> int:
        return int(self.limits["max-buffer-size"])

    @property
    def offset_alignment(self) -> int:
        return int(self.limits.get("min-storage-buffer-offset-alignment", 256))


def adapter_name(adapter) -> str:
    info = adapter.info
    return f"{info.get('device', '?')} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')})"


def _wgpu():
    try:
        import wgpu
    except ImportError as e:  # pragma: no cover - wgpu is a dependency
        raise GPUError(f"the wgpu package cannot be imported ({e}); expected wgpu>=0.32") from None
    return wgpu


def _all_adapters() -> list:
    wgpu = _wgpu()
    try:
        return list(wgpu.gpu.enumerate_adapters_sync())
    except Exception as e:  # wgpu-native raises plain RuntimeError when no driver loads
        raise GPUError(f"{NO_ADAPTER_HELP} ({e})") from None


def pick_adapter():
    """AIRFRAME_ADAPTER (a substring of the adapter's name) or the high-performance adapter."""
    wanted = os.environ.get("AIRFRAME_ADAPTER", "").strip()
    if wanted:
        adapters = _all_adapters()
        for adapter in adapters:
            if wanted.lower() in adapter_name(adapter).lower():
                return adapter
        names = "; ".join(adapter_name(a) for a in adapters) or "none"
        raise GPUError(f"AIRFRAME_ADAPTER={wanted!r} matches no adapter; found: {names}")
    try:
        adapter = _wgpu().gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as e:
        raise GPUError(f"{NO_ADAPTER_HELP} ({e})") from None
    if adapter is None:
        raise GPUError(NO_ADAPTER_HELP)
    return adapter


def _request_device(adapter) -> GPUContext:
    features = [f for f in OPTIONAL_FEATURES if f in adapter.features]
    offered = dict(adapter.limits)
    limits = {name: offered[name] for name in WANTED_LIMITS if name in offered}
    try:
        device = adapter.request_device_sync(required_features=features, required_limits=limits)
    except Exception as e:
        raise GPUError(f"{adapter_name(adapter)}: device request with features {features} failed: {e}") from None
    return GPUContext(adapter=adapter, device=device, limits=dict(device.limits), features=set(device.features))


@lru_cache(maxsize=1)
def get_context() -> GPUContext:
    """The one device of this process (cached)."""
    return _request_device(pick_adapter())


def describe_adapters() -> str:
    """Every adapter with its limits and features, as text for `airframe info --gpu`."""
    lines = []
    for adapter in _all_adapters():
        lines.append(adapter_name(adapter))
        limits = dict(adapter.limits)
        for name in WANTED_LIMITS + ("min-storage-buffer-offset-alignment",):
            if name in limits:
                lines.append(f"  {name}: {limits[name]:,}")
        used = [f for f in OPTIONAL_FEATURES if f in adapter.features]
        lines.append(f"  features used by airframe: {', '.join(used) or 'none'}")
        lines.append(f"  all features: {', '.join(sorted(adapter.features))}")
    return "\n".join(lines) if lines else NO_ADAPTER_HELP

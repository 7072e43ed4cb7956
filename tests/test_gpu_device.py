"""Adapter choice, limits and features of airframe/gpu/device.py (lavapipe in CI)."""

import pytest

from airframe.errors import GPUError
from airframe.gpu import device


def test_context_takes_the_adapters_full_limits():
    ctx = device.get_context()
    offered = dict(ctx.adapter.limits)
    for name in ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size"):
        assert ctx.limits[name] == offered[name]
    wanted = {f for f in device.OPTIONAL_FEATURES if f in ctx.adapter.features}
    assert wanted <= ctx.features
    assert ctx.has_subgroups == ("subgroup" in ctx.features)


def test_adapter_by_name(monkeypatch):
    name = device.adapter_name(device.get_context().adapter)
    monkeypatch.setenv("AIRFRAME_ADAPTER", name.split()[0].upper())
    assert device.adapter_name(device.pick_adapter()) == name


def test_unknown_adapter_name_lists_what_was_found(monkeypatch):
    monkeypatch.setenv("AIRFRAME_ADAPTER", "no-such-gpu")
    with pytest.raises(GPUError, match=r"AIRFRAME_ADAPTER='no-such-gpu' matches no adapter; found: .+"):
        device.pick_adapter()


def test_describe_adapters_lists_limits_and_features():
    text = device.describe_adapters()
    assert "max-storage-buffer-binding-size" in text and "features used by airframe" in text


def test_no_adapter_says_how_to_install_lavapipe(monkeypatch):
    class NoGPU:
        @staticmethod
        def request_adapter_sync(**kwargs):
            return None

    class FakeWgpu:
        gpu = NoGPU

    monkeypatch.delenv("AIRFRAME_ADAPTER", raising=False)
    monkeypatch.setattr(device, "_wgpu", lambda: FakeWgpu)
    with pytest.raises(GPUError, match="apt-get install mesa-vulkan-drivers"):
        device.pick_adapter()

"""A stand-in for Intel Gaudi's ``habana_frameworks`` package, for tests without a Gaudi.

``install`` registers it in ``sys.modules`` under the real module names for one test, and
points ``HpuPlatform`` at CPU tensors (its ``device_type``), so the engine runs the HPU
platform's own code path: shape bucketing, warm-up, ``mark_step`` after every forward, the
HPU graph runner, peak-memory profiling. Nothing here registers an ``hpu`` device with torch.
``core.mark_step`` and ``hpu.wrap_in_hpu_graph`` record their calls; the graph wrapper runs
the module eagerly.
"""

from __future__ import annotations

import sys
import types

import pytest

from tests.platforms.hpu.fake_habana import core, hpu


def install(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Fake habana_frameworks for this test; returns the recorders (``core``, ``hpu``)."""
    from pagedserve.platforms.hpu.platform import HpuPlatform

    package = types.ModuleType("habana_frameworks")
    bridge = types.ModuleType("habana_frameworks.torch")
    bridge.core, bridge.hpu = core, hpu
    package.torch = bridge
    modules = {"habana_frameworks": package, "habana_frameworks.torch": bridge,
               "habana_frameworks.torch.core": core, "habana_frameworks.torch.hpu": hpu}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    core.reset()
    hpu.reset()
    monkeypatch.setattr(HpuPlatform, "device_type", "cpu")
    # CPU-only torch has no pinned-memory allocator (pin_memory=True raises).
    monkeypatch.setattr(HpuPlatform, "pin_swap_memory", False)
    return types.SimpleNamespace(core=core, hpu=hpu)

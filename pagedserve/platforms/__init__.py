"""Platform registry: each entry is imported only when asked for, so a CPU install never imports
triton, habana or a GPU runtime."""

from __future__ import annotations

import importlib

from pagedserve.logger import get_logger, info_once
from pagedserve.platforms.interface import Platform, PlatformUnavailable

logger = get_logger(__name__)

_REGISTRY = {
    "cuda": "pagedserve.platforms.cuda.platform:CudaPlatform",
    "rocm": "pagedserve.platforms.rocm.platform:RocmPlatform",
    "hpu": "pagedserve.platforms.hpu.platform:HpuPlatform",
    "cpu": "pagedserve.platforms.cpu.platform:CpuPlatform",
}
# "auto" tries accelerators first and always ends on the CPU.
_AUTO_ORDER = ("cuda", "rocm", "hpu", "cpu")
DEVICE_NAMES = ("auto", *_REGISTRY)


def _load(name: str) -> type[Platform]:
    module_name, class_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def resolve_platform(name: str = "auto") -> type[Platform]:
    """The platform class for ``--device NAME``; raises ``PlatformUnavailable`` in one line."""
    if name == "auto":
        return _resolve_auto()
    if name not in _REGISTRY:
        raise PlatformUnavailable(
            f"unknown device {name!r}; choose one of: {', '.join(DEVICE_NAMES)}"
        )
    platform = _load(name)
    platform.check_available()
    return platform


def _resolve_auto() -> type[Platform]:
    """The first usable platform of ``_AUTO_ORDER``, logged in one line with the reason each
    earlier one was skipped (its ``PlatformUnavailable`` message)."""
    skipped: list[str] = []
    for candidate in _AUTO_ORDER:
        platform = _load(candidate)
        try:
            platform.check_available()
        except PlatformUnavailable as exc:
            skipped.append(f"{candidate}: {exc}")
            continue
        why = f"; skipped {'; '.join(skipped)}" if skipped else ""
        info_once(logger, ("device", candidate, why), "--device auto chose %s%s", candidate, why)
        return platform
    raise PlatformUnavailable(f"no usable device found; skipped {'; '.join(skipped)}")


__all__ = ["DEVICE_NAMES", "Platform", "PlatformUnavailable", "resolve_platform"]

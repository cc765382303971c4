"""The host's memory, from ``/proc/meminfo``: what the CPU platform's KV pool and every
platform's host pools (swap, the KV offloading tier) are sized against."""

from __future__ import annotations

import os


def _meminfo_bytes(key: str) -> int | None:
    """A ``/proc/meminfo`` field in bytes; None where there is no such file or field."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def total_bytes() -> int:
    total = _meminfo_bytes("MemTotal")
    return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes() -> int:
    """What can be allocated without swapping (the kernel's estimate); the total where the
    kernel gives none."""
    return _meminfo_bytes("MemAvailable") or total_bytes()

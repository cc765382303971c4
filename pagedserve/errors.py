"""Errors and constants shared by every layer, at the bottom of the import graph (it imports
nothing), so that the platforms and the weight forms can name a flag to change, or check a
flag's value, without importing the config that imports them."""

from __future__ import annotations

# ``--kv-cache-dtype``'s choices; the CUDA attention backend checks its argument against them.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")


class ConfigError(ValueError):
    """A setting the user must change; the message names the flag."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode): it takes no request until ``wake_up``."""

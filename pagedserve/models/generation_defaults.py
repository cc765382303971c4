"""``--generation-config``: the sampling defaults a model's authors ship in its
``generation_config.json`` (Llama-3.1-Instruct: temperature 0.6, top_p 0.9), used for what a
request leaves unset, as vLLM does by default. Without them a request that names no
temperature samples at 1.0, and the same model reads worse here than under vLLM.

``auto`` reads the model's folder, ``vllm`` keeps the API's own defaults (temperature 1, no
truncation), any other value names a folder holding a ``generation_config.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pagedserve.errors import ConfigError
from pagedserve.logger import get_logger
from pagedserve.sampling_params import SamplingParams
from pagedserve.user_paths import expand_user

logger = get_logger(__name__)

FILE_NAME = "generation_config.json"
# generation_config.json's key -> the SamplingParams field it sets, the keys vLLM reads.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INTEGER_FIELDS = ("top_k", "max_tokens")


def check_setting(setting: str) -> None:
    """Raise ``ConfigError`` unless ``setting`` is auto, vllm or a folder with the file."""
    if setting in ("auto", "vllm"):
        return
    if not (expand_user(setting) / FILE_NAME).is_file():
        raise ConfigError(f"--generation-config: {setting} is neither auto, vllm nor a folder "
                          f"holding a {FILE_NAME}")


def generation_overrides(raw: dict[str, object] | None) -> dict[str, float | int] | None:
    """``--override-generation-config``'s object as SamplingParams fields; ``ConfigError`` for
    a key that is none of generation_config.json's sampling keys or a value unusable there.
    Unlike a model's file, these are the user's own words, so nothing is left out quietly."""
    if raw is None:
        return None
    overrides = {}
    for key, value in raw.items():
        if key not in _FIELDS:
            raise ConfigError(f"--override-generation-config: {key!r} is not one of "
                              f"{', '.join(_FIELDS)}")
        usable = _usable(_FIELDS[key], value)
        if usable is None:
            raise ConfigError(f"--override-generation-config: {key} {value!r} is not a usable "
                              "sampling default")
        overrides[_FIELDS[key]] = usable
    return overrides


def sampling_defaults(setting: str, model_folder: Path,
                      overrides: dict[str, object] | None = None) -> dict[str, float | int]:
    """The SamplingParams fields that ``setting`` (``check_setting``'d) gives defaults, for a
    model in ``model_folder``, with ``overrides`` (``--override-generation-config``'s object)
    over them. A file's value of the wrong kind or out of range is left out with a warning: a
    model's file must not stop it from serving."""
    defaults = _file_defaults(setting, model_folder) | (generation_overrides(overrides) or {})
    if defaults:
        logger.info("sampling defaults for requests that leave them unset: %s "
                    "(--generation-config vllm turns the model's off)", defaults)
    return defaults


def _file_defaults(setting: str, model_folder: Path) -> dict[str, float | int]:
    if setting == "vllm":
        return {}
    path = (model_folder if setting == "auto" else expand_user(setting)) / FILE_NAME
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        logger.warning("%s unread (%s); sampling defaults are the API's", path, exc)
        return {}
    defaults = {}
    for key, name in _FIELDS.items():
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None:
            continue
        value = _usable(name, value)
        if value is None:
            logger.warning("%s: %s %r is not a usable default; left out", path, key, raw[key])
        else:
            defaults[name] = value
    return defaults


def _usable(name: str, value: object) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    if name in _INTEGER_FIELDS:
        if value != int(value):
            return None
        value = int(value)
        if name == "top_k" and value == 0:  # transformers' "no top-k"
            value = -1
        if name == "max_tokens" and value < 1:  # 0 would generate nothing
            return None
    try:
        SamplingParams(**{name: value})
    except (ValueError, TypeError):
        return None
    return value

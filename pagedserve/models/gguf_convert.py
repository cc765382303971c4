"""Turn a llama, qwen3, phi3 or granite GGUF file into a Hugging Face folder, once, in the
pagedserve cache.

The engine only reads Hugging Face folders, so a GGUF becomes safetensors with HF tensor names,
a ``config.json`` built from its metadata, and a tokenizer. Q4_0, Q4_1 and Q8_0 matrices keep
their raw blocks (read by ``quant.formats.gguf``), so they stay quantized in memory; every other
type is dequantized to float32 here. The result lives in
``<cache>/gguf/<first 16 hex of the file's sha256>.v<FORMAT_VERSION>/`` and is reused by every
later start: a cache hit only hashes the file and never parses the GGUF.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from pagedserve.logger import get_logger
from pagedserve.models.config import UnsupportedModel

logger = get_logger(__name__)

# Written last into a finished conversion; a folder without it is not one. The output format's
# version is part of the folder name, so a conversion of an older format is never reused.
STAMP_FILE = "pagedserve_gguf.json"
FORMAT_VERSION = 2
# Types kept as blocks; the name is the stored tensor's suffix (``<module>.gguf_q4_1``).
BLOCK_TYPES = {gguf.GGMLQuantizationType.Q4_0: "q4_0", gguf.GGMLQuantizationType.Q4_1: "q4_1",
               gguf.GGMLQuantizationType.Q8_0: "q8_0"}
_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16)
MAX_SHARD_BYTES = 2 << 30


class _Arch(NamedTuple):
    hf_name: str
    model_type: str
    # llama.cpp's converter permutes the Q/K rows of LlamaModel and its subclasses (Granite);
    # its qwen3 and phi3 tensors keep the Hugging Face order.
    permuted_qk: bool


_ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", True),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", False),
    "phi3": _Arch("Phi3ForCausalLM", "phi3", False),
    "granite": _Arch("GraniteForCausalLM", "granite", True),
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3 keeps its checkpoint's fused tensors: q, k, v rows in ``attn_qkv`` and gate, up rows in
# ``ffn_up`` (2 x feed_forward_length rows), the layout Phi3ForCausalLM's loader cuts apart.
_PHI3_LAYER_TENSORS = {**_LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj",
                       "ffn_up": "mlp.gate_up_proj"}
# Phi-3's longrope frequency factors: tensors in the GGUF, rope_scaling in config.json.
_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor",
                 "rope_factors_long.weight": "long_factor"}
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


class GGUFConvertError(ValueError):
    """The GGUF file cannot be read or lacks what a Hugging Face folder needs."""


class Conversion(NamedTuple):
    path: Path
    name: str
    reused: bool


def display_name(gguf_path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``."""
    return _QUANT_SUFFIX.sub("", gguf_path.stem)


def converted_name(folder: Path) -> str | None:
    """The display name recorded in a finished conversion, or None for any other folder."""
    stamp = folder / STAMP_FILE
    return json.loads(stamp.read_text())["name"] if stamp.is_file() else None


def cached_convert(gguf_path: Path, cache_root: Path) -> Conversion:
    """The HF folder for ``gguf_path``, converting it first unless the cache already has it."""
    digest = file_sha256(gguf_path)
    final = cache_root / "gguf" / f"{digest[:16]}.v{FORMAT_VERSION}"
    name = display_name(gguf_path)
    if (final / STAMP_FILE).is_file():
        return Conversion(final, name, reused=True)
    logger.info("converting %s to a Hugging Face folder in %s (once)", gguf_path.name, final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final place so the publishing rename stays on one filesystem.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        convert_gguf(gguf_path, tmp)
        stamp = {"name": name, "gguf": gguf_path.name, "sha256": digest}
        _write_json(tmp / STAMP_FILE, stamp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Conversion(final, name, reused=False)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished conversion into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError as exc:
        if not (final / STAMP_FILE).is_file():
            raise GGUFConvertError(
                f"{final} exists but is not a finished conversion; delete it and retry"
            ) from exc


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, generation config, safetensors and tokenizer into ``out_dir``."""
    reader = open_gguf(gguf_path)
    config = hf_config(reader)
    write_safetensors(iter_hf_tensors(reader, config), out_dir)
    _write_json(out_dir / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config.get(k) is not None}
    _write_json(out_dir / "generation_config.json", generation)
    write_tokenizer(gguf_path, out_dir, config["max_position_embeddings"])


def open_gguf(gguf_path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, IndexError, OSError) as exc:
        # The reader checks every tensor's extent, so truncation shows up here, not later.
        raise GGUFConvertError(
            f"{gguf_path} is not a readable GGUF file (corrupt or truncated?): {exc}"
        ) from exc


def hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """A Llama, Qwen3, Phi3 or Granite ``...ForCausalLM`` ``config.json`` from the GGUF
    metadata."""
    arch = _meta(reader, "general.architecture")
    # llama.cpp stores Mixtral as "llama" with stacked experts (ffn_gate_exps ...).
    if arch == "qwen3moe" or _meta(reader, f"{arch}.expert_count", 0):
        raise UnsupportedModel(
            f"GGUF mixture-of-experts models ({arch}) are not supported; load the Hugging Face "
            "safetensors checkpoint (MixtralForCausalLM, Qwen2MoeForCausalLM, "
            "Qwen3MoeForCausalLM) instead")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(_ARCHITECTURES)}"
        )
    hf_arch, model_type, _ = _ARCHITECTURES[arch]
    hidden = _meta(reader, f"{arch}.embedding_length")
    heads = _meta(reader, f"{arch}.attention.head_count")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFConvertError("the GGUF file has no token_embd.weight tensor")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        # GGUF dims are reversed: token_embd is (hidden, vocab) there.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": _meta(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _meta(reader, f"{arch}.attention.key_length", hidden // heads),
        "max_position_embeddings": _meta(reader, f"{arch}.context_length"),
        "rms_norm_eps": _f32(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _eos_token_ids(reader),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
    }
    if arch == "phi3":
        config.update(_phi3_config(reader, tensors, config["head_dim"]))
    elif arch == "granite":
        config.update(_granite_config(reader, config["head_dim"]))
    return config


def _phi3_config(reader: gguf.GGUFReader, tensors: dict[str, Any],
                 head_dim: int) -> dict[str, Any]:
    """Phi-3's partial rotary (``rope.dimension_count`` of ``head_dim``), sliding window (0:
    none) and longrope: llama.cpp's converter writes no scaling type, only the two factor
    tensors and ``original_context_length``. The attention factor it stores is the one
    transformers computes from the two lengths, so it is left to be computed again."""
    rotary = _meta(reader, "phi3.rope.dimension_count", head_dim)
    fields: dict[str, Any] = {
        "partial_rotary_factor": rotary / head_dim,
        "sliding_window": _meta(reader, "phi3.attention.sliding_window", 0) or None,
        "original_max_position_embeddings":
            _meta(reader, "phi3.rope.scaling.original_context_length", None),
    }
    factors = {key: [_f32(v) for v in tensors[name].data]
               for name, key in _ROPE_FACTORS.items() if name in tensors}
    if factors:
        if len(factors) != 2 or fields["original_max_position_embeddings"] is None:
            raise GGUFConvertError("a phi3 GGUF with longrope needs rope_factors_short, "
                                   "rope_factors_long and rope.scaling.original_context_length")
        fields["rope_scaling"] = {"type": "longrope", **factors}
    return fields


def _granite_config(reader: gguf.GGUFReader, head_dim: int) -> dict[str, Any]:
    """Granite's four scalars. llama.cpp's converter writes each only when the config has it
    (non-zero), and llama.cpp runs a missing one as 1 (the softmax scale as 1/sqrt(head_dim))."""
    return {
        "embedding_multiplier": _f32(_meta(reader, "granite.embedding_scale", 1.0)),
        "residual_multiplier": _f32(_meta(reader, "granite.residual_scale", 1.0)),
        "attention_multiplier": _f32(_meta(reader, "granite.attention.scale", head_dim ** -0.5)),
        "logits_scaling": _f32(_meta(reader, "granite.logit_scale", 1.0)),
    }


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_meta(reader, f"{arch}.rope.scaling.factor"))}
    raise UnsupportedModel(f"GGUF rope scaling {kind!r} is not supported; supported: linear")


def _eos_token_ids(reader: gguf.GGUFReader) -> int | list[int] | None:
    # llama.cpp stops on end-of-turn tokens too; generation should as well.
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [_meta(reader, f"tokenizer.ggml.{k}", None) for k in keys]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else (ids or None)


def iter_hf_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its HF name and in HF layout: Q4_0/Q4_1/Q8_0 matrices as their raw
    blocks ``uint8 [rows, row bytes]``, the rest dequantized to float32."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    model_type = config["model_type"]
    permuted = model_type in {a.model_type for a in _ARCHITECTURES.values() if a.permuted_qk}
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        if model_type == "phi3" and tensor.name in _ROPE_FACTORS:
            continue  # in config.json's rope_scaling
        name = hf_tensor_name(tensor.name, model_type)
        # GGUF lists dims innermost first; HF (and numpy) outermost first.
        shape = [int(d) for d in reversed(tensor.shape)]
        block_type = BLOCK_TYPES.get(tensor.tensor_type)
        if block_type is not None and len(shape) == 2:
            values = np.asarray(tensor.data, dtype=np.uint8).reshape(shape[0], -1)
            name = f"{name.removesuffix('.weight')}.gguf_{block_type}"
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            values = values.astype(np.float32, copy=False)
            if tensor.tensor_type not in _FLOAT_TYPES:
                kind = tensor.tensor_type.name
                dequantized[kind] = dequantized.get(kind, 0) + 1
        if permuted and ".self_attn.q_proj." in name:
            values = unpermute_rows(values, heads)
        elif permuted and ".self_attn.k_proj." in name:
            values = unpermute_rows(values, kv_heads)
        # A copy: tensors are read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(values))
    if dequantized:
        logger.info("GGUF tensors of type %s are dequantized to float32 (only Q4_0, Q4_1 and "
                    "Q8_0 stay quantized)",
                    ", ".join(f"{kind} ({n})" for kind, n in sorted(dequantized.items())))


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = (_PHI3_LAYER_TENSORS if model_type == "phi3" else _LAYER_TENSORS).get(part)
        prefix = f"model.layers.{layer}."
    else:
        mapped, prefix = _GLOBAL_TENSORS.get(base), ""
    if mapped is None:
        raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no {model_type} Hugging Face "
                               "counterpart")
    return f"{prefix}{mapped}.{kind}"


def unpermute_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    Its converter interleaves each head's two rotary halves for its own rope kernel:
    ``w.reshape(heads, 2, dim // 2, ...).swapaxes(1, 2)``. Swapping the same axes back restores
    the Hugging Face order, where rows ``i`` and ``i + dim // 2`` form a rotary pair.
    """
    head_dim = values.shape[0] // num_heads
    grouped = values.reshape(num_heads, head_dim // 2, 2, *values.shape[1:])
    return grouped.swapaxes(1, 2).reshape(values.shape)


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """``model.safetensors``, or HF-style shards plus an index once past ``max_shard_bytes``.

    Shards are written as they fill, so a large model never sits in memory whole.
    """
    shards: list[tuple[Path, list[str]]] = []
    total = 0
    for index, shard in enumerate(_group_by_size(tensors, max_shard_bytes)):
        path = out_dir / f"shard-{index}.tmp"
        save_file(shard, path, metadata={"format": "pt"})
        shards.append((path, list(shard)))
        total += sum(t.nbytes for t in shard.values())
    if len(shards) == 1:
        shards[0][0].rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for number, (path, names) in enumerate(shards, start=1):
        final = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        path.rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _group_by_size(
    tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        if shard and size + tensor.nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += tensor.nbytes
    if shard:
        yield shard


def write_tokenizer(gguf_path: Path, out_dir: Path, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template).

    transformers already rebuilds a GGUF's tokenizer (byte-level BPE or sentencepiece, special
    tokens, pre-tokenizer split) for ``from_pretrained(gguf_file=...)``; we save what it builds,
    so a folder load encodes exactly like its GGUF load.
    """
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, vocab, settings = get_gguf_tokenizer(str(gguf_path))
    try:
        backend, _ = convert_gguf_tokenizer(architecture, vocab)
    except ValueError as exc:
        raise UnsupportedModel(f"cannot build the tokenizer of {gguf_path.name}: {exc}") from exc
    backend.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        # The generic class uses tokenizer.json as saved; a model-specific one may rebuild it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        **{k: v for k, v in settings.items() if v is not None},
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


_MISSING = object()


def _meta(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise GGUFConvertError(f"the GGUF file lacks the metadata key {key!r}")
    return default


def _f32(value: float) -> float:
    # GGUF stores float32: write its shortest form, so 1e-5 does not become 9.999999747378752e-06.
    return float(str(np.float32(value)))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

"""FP8 and compressed-tensors checkpoints of the tiny models, written in their on-disk layouts,
each beside a float32 folder of the same model holding its weights dequantized by an
independent implementation (float64 arithmetic for FP8; the compressed-tensors package's own
decompressors for compressed-tensors), which transformers loads as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from tests.quant.packers import is_decoder_linear
from tests.tiny_models import assert_greedy_matches, hf_model, random_prompts

E4M3_MAX = 448.0
PROMPT_LENS = [3, 11, 29]
NEW_TOKENS = 16


class Checkpoint(NamedTuple):
    quantized: Path  # as the format stores it
    reference: Path  # float32, the same weights dequantized independently
    dequantized: dict[str, torch.Tensor]  # the reference's linear weights by module


def is_linear(name: str, tensor: torch.Tensor) -> bool:
    """The decoder's linear weights, routed experts' too (the LM head, embeddings and MoE
    routers stay float)."""
    return is_decoder_linear(name) and tensor.dim() == 2


def copy_folder(src: Path, dst: Path, state: dict[str, torch.Tensor],
                quantization_config: dict | None = None) -> Path:
    """``src``'s config and tokenizer with ``state`` as its weights."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in state.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64) rounded to the nearest e4m3 value, computed without float8 dtypes:
    3 mantissa bits, exponents down to -6, subnormals in steps of 2**-9, saturating at 448."""
    x = x.double().clamp(-E4M3_MAX, E4M3_MAX)
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -6))).clamp(min=-6)
    step = torch.exp2(exponent - 3)
    # torch.round rounds halves to even, as a float cast does.
    return torch.round(x / step) * step


def write_fp8(src: Path, dst: Path, static: bool, seed: int = 0) -> Checkpoint:
    """A vLLM-style FP8 checkpoint: per-tensor float32 ``weight_scale`` (a scalar, or ``[1]``
    on every other layer), float8_e4m3fn ``weight``, a static ``input_scale`` if asked for;
    the LM head listed in ``ignored_layers`` and stored float."""
    gen = torch.Generator().manual_seed(seed)
    state, reference, dequantized = {}, {}, {}
    for i, (name, w) in enumerate(sorted(load_file(src / "model.safetensors").items())):
        if not is_linear(name, w):
            state[name] = reference[name] = w
            continue
        module = name.removesuffix(".weight")
        scale = (w.abs().amax() / E4M3_MAX).float()
        state[name] = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        state[f"{module}.weight_scale"] = scale.reshape(1) if i % 2 else scale
        if static:
            state[f"{module}.input_scale"] = torch.rand((), generator=gen) / 100 + 1e-3
        # float64 holds e4m3 (4 significant bits) times a float32 scale exactly.
        reference[name] = dequantized[module] = (
            state[name].double() * scale.double()).float()
    config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
              "ignored_layers": ["lm_head"]}
    return Checkpoint(copy_folder(src, dst / "fp8", state, config),
                      copy_folder(src, dst / "reference", reference), dequantized)


def write_compressed_tensors_fp8(src: Path, dst: Path, ignore: tuple[str, ...]) -> Checkpoint:
    """llm-compressor's FP8 W8A8 with static per-tensor scales (neuralmagic's Mixtral FP8), its
    ``float-quantized`` layout written tensor by tensor (the compressed-tensors package
    quantizes ``nn.Linear`` modules only, and transformers 5 holds a layer's experts as one
    module of 3-d weights): float8_e4m3fn ``weight``, bfloat16 ``weight_scale`` and
    ``input_scale`` of shape ``[1]``. The reference multiplies in float64."""
    state, reference, dequantized = {}, {}, {}
    for name, w in sorted(load_file(src / "model.safetensors").items()):
        if not is_linear(name, w):
            state[name] = reference[name] = w
            continue
        module = name.removesuffix(".weight")
        scale = (w.abs().amax() / E4M3_MAX).to(torch.bfloat16).reshape(1)
        state[name] = (w / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        state[f"{module}.weight_scale"] = scale
        state[f"{module}.input_scale"] = torch.tensor([0.0123], dtype=torch.bfloat16)
        reference[name] = dequantized[module] = (
            state[name].double() * scale.double()).float()
    fp8 = dict(type="float", num_bits=8, symmetric=True, strategy="tensor", dynamic=False)
    config = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "quantization_status": "compressed", "ignore": list(ignore),
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp8,
                                            "input_activations": fp8}}}
    return Checkpoint(copy_folder(src, dst / "compressed-tensors", state, config),
                      copy_folder(src, dst / "reference", reference), dequantized)


def write_block_fp8(src: Path, dst: Path, block: tuple[int, int]) -> Checkpoint:
    """Block-wise FP8 as Qwen3-FP8 (and DeepSeek-V3) store it: float8_e4m3fn ``weight`` and a
    float32 ``weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]``, one scale per tile mapping
    the tile's largest magnitude to 448 (the last tiles partial where N or K is not a multiple
    of the block); dynamic activations, the LM head unconverted. The reference multiplies
    each tile by its scale, tile by tile, in float64."""
    state, reference, dequantized = {}, {}, {}
    for name, w in sorted(load_file(src / "model.safetensors").items()):
        if not is_linear(name, w):
            state[name] = reference[name] = w
            continue
        module = name.removesuffix(".weight")
        values, scales, exact = _block_quantized(w, block)
        state[name], state[f"{module}.weight_scale_inv"] = values, scales
        reference[name] = dequantized[module] = exact.float()
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    return Checkpoint(copy_folder(src, dst / "block-fp8", state, config),
                      copy_folder(src, dst / "reference", reference), dequantized)


def _block_quantized(w: torch.Tensor, block: tuple[int, int]):
    """``(values, scales, float64 dequantized)`` of one weight in tiles of ``block``."""
    (n, k), (bn, bk) = w.shape, block
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // bn), -(-k // bk))
    exact = torch.empty(n, k, dtype=torch.float64)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            scale = (w[rows, cols].abs().amax() / E4M3_MAX).float()
            values[rows, cols] = (w[rows, cols] / scale).clamp(-E4M3_MAX, E4M3_MAX).to(
                torch.float8_e4m3fn)
            scales[i, j] = scale
            exact[rows, cols] = values[rows, cols].double() * scale.double()
    return values, scales, exact


def write_fp8_at_load_reference(src: Path, dst: Path) -> Checkpoint:
    """``src`` with each linear weight rounded as ``--quantization fp8`` does: per output row,
    the scale maps the row's largest magnitude to 448, values round to e4m3 (in float64)."""
    reference, dequantized = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if is_linear(name, w):
            scale = (w.double().abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).double()
            w = dequantized[name.removesuffix(".weight")] = (
                e4m3_round(w.double() / scale) * scale).float()
        reference[name] = w
    return Checkpoint(src, copy_folder(src, dst / "reference", reference), dequantized)


def write_compressed_tensors(src: Path, dst: Path, weights: dict, inputs: dict | None = None,
                             ignore: tuple[str, ...] = ("lm_head",)) -> Checkpoint:
    """``src`` quantized and compressed as llm-compressor does, through the compressed-tensors
    package: the scheme applied to the model, its scales (bfloat16, as in a bfloat16 model)
    and zero points computed from each weight's range by the package's ``calculate_qparams``,
    then ``ModelCompressor`` compresses, ``save_pretrained`` writes and ``update_config`` adds
    the ``quantization_config``. The reference holds each module decompressed by the package's
    compressor for its format, in float32."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**inputs) if inputs else None)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=list(ignore)),
                              show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    folder = dst / "compressed-tensors"
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    for extra in src.glob("*token*"):
        shutil.copy(extra, folder)
    reference, dequantized = _decompressed(folder, model)
    return Checkpoint(folder, copy_folder(src, dst / "reference", reference), dequantized)


def _calibrate(module: torch.nn.Module) -> None:
    """What llm-compressor's min-max observer leaves on a module: scales and zero points from
    each group's (or row's, or the tensor's) range; a static input scale, made up."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.data
    if args.strategy == "group":
        grouped = w.unflatten(-1, (-1, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.to(torch.bfloat16)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    if hasattr(module, "input_scale"):
        module.input_scale.data = torch.full_like(module.input_scale.data, 0.0123)
    module.quantization_status = QuantizationStatus.FROZEN


def _decompressed(folder: Path, model) -> tuple[dict[str, torch.Tensor], dict]:
    """The checkpoint in ``folder`` with each quantized module decompressed by the package."""
    from compressed_tensors.compressors import BaseCompressor

    stored = load_file(folder / "model.safetensors")
    schemes = {name: m.quantization_scheme for name, m in model.named_modules()
               if getattr(m, "quantization_scheme", None) is not None}
    reference, dequantized = {}, {}
    for name, tensor in stored.items():
        module, _, part = name.rpartition(".")
        if module not in schemes:
            reference[name] = tensor
            continue
        if part not in ("weight", "weight_packed"):
            continue
        scheme = schemes[module]
        parts = {p.rpartition(".")[2]: t for p, t in stored.items()
                 if p.rpartition(".")[0] == module}
        # float32 scales: the package then dequantizes in float32 ((q - z) * s, exact for
        # 4-bit q and bfloat16 s).
        parts["weight_scale"] = parts["weight_scale"].float()
        compressor = BaseCompressor.get_value_from_registry(scheme.format.value)
        weight = compressor.decompress(parts, scheme)["weight"]
        assert weight.dtype == torch.float32
        reference[f"{module}.weight"] = dequantized[module] = weight
    return reference, dequantized


def assert_greedy_matches_hf(llm, reference: Path, seed: int = 5) -> None:
    """Greedy tokens of ``llm`` equal transformers' on the reference folder (see
    ``assert_greedy_matches``), and at least one prompt matches to the end."""
    prompts = random_prompts(seed, PROMPT_LENS)
    assert assert_greedy_matches(llm, hf_model(reference), prompts, NEW_TOKENS) >= 1

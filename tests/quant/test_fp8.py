"""FP8 checkpoints (quant_method fp8) and ``--quantization fp8``: what the format unpacks, what
the engine holds, and greedy tokens against transformers holding the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.models import loader
from pagedserve.models.loader import iter_weights, load_arch_config, resolve_model
from pagedserve.quant.formats import QuantConfigError, checkpoint_format
from pagedserve.quant.weights import Fp8Weight
from tests.quant.fp8_ct_checkpoints import (
    assert_greedy_matches_hf,
    write_fp8,
    write_fp8_at_load_reference,
)
from tests.tiny_models import make_llm


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_model_folder, tmp_path_factory):
    """``(arch, static) -> Checkpoint``, each written once."""
    made = {}

    def get(arch: str, static: bool):
        if (arch, static) not in made:
            dst = tmp_path_factory.mktemp(f"fp8-{arch}-{'static' if static else 'dynamic'}")
            made[arch, static] = write_fp8(tiny_model_folder(arch), dst, static)
        return made[arch, static]

    return get


def read_checkpoint(folder: Path, quantization: str = "auto") -> dict:
    source = resolve_model(str(folder))
    fmt = checkpoint_format(load_arch_config(source).raw, quantization, source.gguf)
    return dict(fmt.read(iter_weights(source)))


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_unpack_equals_float64_dequantization(fp8_checkpoints, static):
    ckpt = fp8_checkpoints("llama3", static)
    got = read_checkpoint(ckpt.quantized)
    raw = load_file(ckpt.quantized / "model.safetensors")
    for module, expected in ckpt.dequantized.items():
        weight = got[f"{module}.weight"]
        assert isinstance(weight, Fp8Weight)
        assert weight.values.dtype == torch.float8_e4m3fn
        assert torch.equal(weight.dequantize(), expected), module
        if static:
            assert weight.input_scale == float(raw[f"{module}.input_scale"])
        else:
            assert weight.input_scale is None
    # Unquantized tensors (the ignored LM head, embeddings, norms) pass through unchanged.
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert got[name].dtype == torch.float32 and torch.equal(got[name], raw[name])


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_engine_matches_transformers(fp8_checkpoints, arch, static):
    ckpt = fp8_checkpoints(arch, static)
    assert_greedy_matches_hf(make_llm(ckpt.quantized, dtype="float32"), ckpt.reference)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_quantize_at_load_holds_per_row_e4m3_weights(tiny_model_folder, tmp_path, arch):
    src = tiny_model_folder(arch)
    ref = write_fp8_at_load_reference(src, tmp_path)
    llm = make_llm(src, dtype="float32", quantization="fp8")
    model = llm.engine.executor.runner.model
    for i in range(2):
        layer = f"model.layers.{i}"
        attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        expected = {
            f"{attn}.qkv_proj": [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"],
            f"{attn}.o_proj": [f"{attn}.o_proj"],
            f"{mlp}.gate_up_proj": [f"{mlp}.gate_proj", f"{mlp}.up_proj"],
            f"{mlp}.down_proj": [f"{mlp}.down_proj"],
        }
        for fused, parts in expected.items():
            held = model.get_submodule(fused).weight
            assert torch.equal(held, torch.cat([ref.dequantized[p] for p in parts])), fused
    # The LM head keeps the checkpoint's float weight (Qwen2's is the tied embedding).
    raw = load_file(src / "model.safetensors")
    head = raw.get("lm_head.weight", raw["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, head)
    assert_greedy_matches_hf(llm, ref.reference)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _one_line_error(config: dict, quantization: str) -> str:
    with pytest.raises(QuantConfigError) as err:
        checkpoint_format(config, quantization, False)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_quantization_flag_mismatches_are_one_line_errors(fp8_checkpoints):
    fp8 = _config(fp8_checkpoints("llama3", False).quantized)
    assert "which is fp8" in _one_line_error(fp8, "awq")
    ct = {**fp8, "quantization_config": {"quant_method": "compressed-tensors"}}
    assert "already quantized (compressed-tensors)" in _one_line_error(ct, "fp8")
    awq = {**fp8, "quantization_config": {"quant_method": "awq", "bits": 4}}
    assert "already quantized (awq)" in _one_line_error(awq, "fp8")


@pytest.mark.parametrize("field,value,needle", [
    ("weight_block_size", [128], "quantization_config.weight_block_size: [128] is not two"),
    ("activation_scheme", "per-token", "quantization_config.activation_scheme: 'per-token'"),
    ("fmt", "e5m2", "quantization_config.fmt: 'e5m2'"),
])
def test_unsupported_config_is_refused_before_any_weight_is_read(
        fp8_checkpoints, tmp_path, monkeypatch, field, value, needle):
    folder = fp8_checkpoints("llama3", False).quantized
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    config = _config(folder)
    config["quantization_config"][field] = value
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))

    def no_reading(source):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loader, "iter_weights", no_reading)
    with pytest.raises(QuantConfigError) as err:
        make_llm(bad, dtype="float32")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_module_listed_as_unconverted_must_be_stored_float(fp8_checkpoints):
    folder = fp8_checkpoints("llama3", True).quantized
    config = _config(folder)
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.down_proj"]
    fmt = checkpoint_format(config, "auto", False)
    with pytest.raises(QuantConfigError, match=r"model\.layers\.0\.mlp\.down_proj is in "
                                               r"quantization_config\.modules_to_not_convert"):
        dict(fmt.read(iter_weights(resolve_model(str(folder)))))


def test_block_fp8_reads_dynamic_activations_and_a_scale_per_tile():
    block = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    with pytest.raises(QuantConfigError, match="activation_scheme: 'static' is not supported"):
        checkpoint_format({"quantization_config": {**block, "activation_scheme": "static"}},
                          "auto", False)
    fmt = checkpoint_format({"quantization_config": block}, "auto", False)
    weight = torch.zeros(48, 64, dtype=torch.float8_e4m3fn)  # 2 x 2 tiles, the last rows partial
    with pytest.raises(QuantConfigError, match=r"m\.weight_scale_inv has shape \(2, 1\); "
                                               r"m\.weight \(48, 64\) .* needs \(2, 2\)"):
        dict(fmt.read([("m.weight", weight), ("m.weight_scale_inv", torch.ones(2, 1))]))

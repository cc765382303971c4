"""compressed-tensors checkpoints written by the compressed-tensors package itself (as
llm-compressor writes them): our unpacking against the package's decompressors, the engine
against transformers holding the decompressed weights, and the configs we refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.models import loader
from pagedserve.models.loader import iter_weights, load_arch_config, resolve_model
from pagedserve.quant.formats import QuantConfigError, checkpoint_format
from pagedserve.quant.formats.compressed_tensors import unpack_int4
from pagedserve.quant.weights import Fp8Weight, GroupQuantWeight
from tests.quant.fp8_ct_checkpoints import assert_greedy_matches_hf, write_compressed_tensors
from tests.tiny_models import make_llm, write_tiny_model

# The checkpoints are written by compressed-tensors itself, whose pinned version needs Python
# 3.11 (pyproject.toml's test extra leaves it out on 3.10).
pytest.importorskip("compressed_tensors", reason="compressed-tensors 0.20 needs Python 3.11+")

FP8 = dict(num_bits=8, type="float", symmetric=True)
SCHEMES = {
    # name: (weights, input activations, group size of the test model's layers)
    "fp8-tensor-static": (dict(FP8, strategy="tensor"), dict(FP8, strategy="tensor",
                                                            dynamic=False)),
    "fp8-channel-dynamic": (dict(FP8, strategy="channel"), dict(FP8, strategy="token",
                                                               dynamic=True)),
    "fp8-channel-weights-only": (dict(FP8, strategy="channel"), None),
    "w4a16-g32": (dict(num_bits=4, type="int", symmetric=True, strategy="group",
                       group_size=32), None),
    "w4a16-g128": (dict(num_bits=4, type="int", symmetric=True, strategy="group",
                        group_size=128), None),
    "w4a16-g32-asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=32), None),
    "w4a16-channel": (dict(num_bits=4, type="int", symmetric=True, strategy="channel"), None),
}
# Group 128 needs every input width to be a multiple of 128.
WIDE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def ct_checkpoint(tiny_model_folder, tmp_path_factory):
    """``(scheme, arch, ignore) -> Checkpoint``, each written once."""
    made = {}

    def get(scheme: str, arch: str = "llama3", ignore: tuple[str, ...] = ("lm_head",)):
        key = scheme, arch, ignore
        if key not in made:
            if scheme == "w4a16-g128":
                src = write_tiny_model(tmp_path_factory.mktemp(f"{arch}-wide"), arch, **WIDE)
            else:
                src = tiny_model_folder(arch)
            weights, inputs = SCHEMES[scheme]
            made[key] = write_compressed_tensors(src, tmp_path_factory.mktemp(scheme),
                                                 weights, inputs, ignore)
        return made[key]

    return get


def read_checkpoint(folder: Path) -> dict:
    source = resolve_model(str(folder))
    fmt = checkpoint_format(load_arch_config(source).raw, "auto", source.gguf)
    return dict(fmt.read(iter_weights(source)))


def test_int4_unpacking_inverts_the_package_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (24, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_to_int32(q, 4)
    assert packed.shape == (24, 12) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed, 96).to(torch.int8) - 8, q)
    # Zero points pack along the output dimension.
    along_rows = pack_to_int32(q, 4, packed_dim=0)
    assert torch.equal(unpack_int4(along_rows.T, 24).T.to(torch.int8) - 8, q)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_unpack_equals_package_decompression(ct_checkpoint, scheme):
    ckpt = ct_checkpoint(scheme)
    config = json.loads((ckpt.quantized / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["strategy"] == \
        SCHEMES[scheme][0]["strategy"]
    got = read_checkpoint(ckpt.quantized)
    raw = load_file(ckpt.quantized / "model.safetensors")
    kind = GroupQuantWeight if scheme.startswith("w4") else Fp8Weight
    for module, expected in ckpt.dequantized.items():
        weight = got[f"{module}.weight"]
        assert isinstance(weight, kind)
        # Exact: e4m3 or 4-bit values times bfloat16 scales fit float32's mantissa.
        assert torch.equal(weight.dequantize(), expected), module
        if scheme == "fp8-tensor-static":
            assert weight.input_scale == float(raw[f"{module}.input_scale"])
        elif kind is Fp8Weight:
            assert weight.input_scale is None
    if scheme == "w4a16-g32-asym":
        zeros = [-w.offsets / w.scales for n, w in got.items() if isinstance(w, GroupQuantWeight)]
        assert len(torch.cat([z.flatten() for z in zeros]).unique()) > 1
    assert torch.equal(got["lm_head.weight"], raw["lm_head.weight"])


def test_ignored_modules_stay_float_and_ignore_is_honoured(ct_checkpoint):
    ignore = ("lm_head", r"re:model\.layers\.1\.mlp\.(gate|up)_proj$",
              "model.layers.0.mlp.down_proj")
    ckpt = ct_checkpoint("w4a16-g32", "llama3", ignore)
    got = read_checkpoint(ckpt.quantized)
    kept_float = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
                  "model.layers.0.mlp.down_proj", "lm_head"]
    for module in kept_float:
        assert got[f"{module}.weight"].dtype == torch.float32
    assert isinstance(got["model.layers.1.mlp.down_proj.weight"], GroupQuantWeight)
    assert isinstance(got["model.layers.0.mlp.gate_proj.weight"], GroupQuantWeight)
    # A module the config ignores must not hold quantized tensors.
    config = json.loads((ckpt.quantized / "config.json").read_text())
    config["quantization_config"]["ignore"].append("model.layers.1.mlp.down_proj")
    fmt = checkpoint_format(config, "auto", False)
    with pytest.raises(QuantConfigError, match=r"model\.layers\.1\.mlp\.down_proj matches "
                                               r"quantization_config\.ignore"):
        dict(fmt.read(iter_weights(resolve_model(str(ckpt.quantized)))))


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", ["fp8-tensor-static", "fp8-channel-dynamic", "w4a16-g32",
                                    "w4a16-g128"])
def test_engine_matches_transformers(ct_checkpoint, scheme, arch):
    ckpt = ct_checkpoint(scheme, arch)
    # int8 activations would move greedy tokens off HF's (docs/platforms.md)
    llm = make_llm(ckpt.quantized, dtype="float32", int8_activations=False)
    down = llm.engine.executor.runner.model.model.layers[0].mlp.down_proj
    if scheme.startswith("w4"):  # the CPU runs these quantized, not dequantized
        assert type(down.method).__name__ in ("NativeQuantLinearMethod", "Int4PackLinearMethod")
    else:
        assert type(down.method).__name__ == "DenseLinearMethod"
    assert_greedy_matches_hf(llm, ckpt.reference)


def _weights(**kw) -> dict:
    return dict(dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                **kw)


def _config(group: dict | None = None, **top) -> dict:
    group = dict(dict(targets=["Linear"], weights=_weights(), format="pack-quantized"),
                 **(group or {}))
    quant = dict(dict(quant_method="compressed-tensors", format="pack-quantized",
                      quantization_status="compressed", config_groups={"group_0": group},
                      ignore=["lm_head"], kv_cache_scheme=None, sparsity_config={}), **top)
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": quant}


W = "quantization_config.config_groups.group_0"


@pytest.mark.parametrize("config,needle", [
    (_config({"weights": _weights(num_bits=2)}), f"{W}.weights.num_bits: 2"),
    (_config({"format": None}, format="marlin-24"), "quantization_config.format: 'marlin-24'"),
    (_config({"format": "float-quantized", "weights": dict(FP8, strategy="block",
                                                           block_structure=[128, 128])}),
     f"{W}.weights.strategy: 'block'"),
    (_config({"weights": _weights(strategy="block")}), f"{W}.weights.strategy: 'block'"),
    (_config({"weights": _weights(actorder="group")}), f"{W}.weights.actorder: 'group'"),
    (_config({"weights": _weights(actorder="weight")}), f"{W}.weights.actorder: 'weight'"),
    (_config({"targets": ["re:.*mlp.*"]}), f"{W}.targets: ['re:.*mlp.*']"),
    (_config(kv_cache_scheme=dict(FP8, strategy="tensor")), "quantization_config.kv_cache_scheme"),
    (_config(sparsity_config={"format": "sparse-24-bitmask"}),
     "quantization_config.sparsity_config"),
    (_config({"input_activations": dict(FP8, strategy="token", dynamic=True)}),
     f"{W}.input_activations"),
    (_config({"format": "float-quantized", "weights": dict(FP8, strategy="channel"),
              "input_activations": dict(FP8, strategy="tensor", dynamic=True)}),
     f"{W}.input_activations.strategy: 'tensor'"),
    (_config(quantization_status="frozen"), "quantization_config.quantization_status"),
])
def test_unsupported_config_is_a_one_line_error(config, needle):
    with pytest.raises(QuantConfigError) as err:
        checkpoint_format(config, "auto", False)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_unsupported_config_is_refused_before_any_weight_is_read(ct_checkpoint, tmp_path,
                                                                 monkeypatch):
    folder = ct_checkpoint("w4a16-g32").quantized
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (bad / "config.json").write_text(json.dumps(config))

    def no_reading(source):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loader, "iter_weights", no_reading)
    with pytest.raises(QuantConfigError, match=rf"{W}\.weights\.num_bits: 2 is not supported"):
        make_llm(bad, dtype="float32")
    with pytest.raises(QuantConfigError, match="which is compressed-tensors"):
        make_llm(folder, dtype="float32", quantization="gptq")

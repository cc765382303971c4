"""Hugging Face model ids: resolved through a hub cache laid out on disk as huggingface_hub lays
it out (refs/, snapshots/, blobs/), offline; and what the online path asks the hub for, with
``snapshot_download`` replaced. Nothing here reaches the network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve.models import loader
from pagedserve.models.loader import ModelLoadError, ModelSource, resolve_model
from tests.hub_cache import NEW, OLD, add_to_cache, offline_cache
from tests.tiny_models import (
    assert_greedy_matches,
    hf_model,
    make_llm,
    random_prompts,
    write_tiny_model,
)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return offline_cache(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny Llamas with different weights: the old and the new commit of one repository."""
    root = tmp_path_factory.mktemp("hub-models")
    return (write_tiny_model(root / "old", "llama3", seed=1),
            write_tiny_model(root / "new", "llama3", seed=2))


@pytest.fixture
def tiny_repo(hub_cache: Path, two_models) -> dict[str, Path]:
    """``org/tiny``: tag v1 at the old commit, main at the new one."""
    old, new = two_models
    return {"old": add_to_cache(hub_cache, "org/tiny", old, OLD, refs=("v1",)),
            "new": add_to_cache(hub_cache, "org/tiny", new, NEW)}


def assert_one_line(exc: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(exc.value) and str(exc.value)


def test_branch_tag_and_commit_resolve_to_their_snapshots(tiny_repo) -> None:
    assert resolve_model("org/tiny") == ModelSource(tiny_repo["new"], "org/tiny", "hub-cache")
    assert resolve_model("org/tiny", revision="main").path == tiny_repo["new"]
    assert resolve_model("org/tiny", revision="v1").path == tiny_repo["old"]
    assert resolve_model("org/tiny", revision=OLD).path == tiny_repo["old"]


def test_a_snapshot_folder_passed_as_a_path_is_named_by_its_repository(tiny_repo) -> None:
    """As the engine core sees the model the API server resolved."""
    source = resolve_model(tiny_repo["old"])
    assert (source.path, source.name, source.origin) == (tiny_repo["old"], "org/tiny",
                                                         "hf-folder")


def test_engine_on_a_hub_id_matches_transformers(tiny_repo, two_models) -> None:
    """Weights and tokenizer both come from the revision's snapshot."""
    from transformers import AutoTokenizer

    old, _ = two_models
    llm = make_llm("org/tiny", revision="v1")
    assert llm.engine.model_name == "org/tiny"
    text = "the quick brown fox 🚀"
    assert (llm.engine.tokenizer(text).input_ids
            == AutoTokenizer.from_pretrained(old)(text).input_ids)
    assert assert_greedy_matches(llm, hf_model(old), random_prompts("hub", [5, 17, 33])) >= 1


def test_revisions_hold_different_weights(tiny_repo) -> None:
    """The two commits differ, so resolving the wrong one could not pass the test above."""
    old = dict(loader.iter_weights(resolve_model("org/tiny", revision="v1")))
    new = dict(loader.iter_weights(resolve_model("org/tiny")))
    assert old.keys() == new.keys()
    assert not torch.equal(old["model.embed_tokens.weight"], new["model.embed_tokens.weight"])


@pytest.mark.parametrize("revision", [None, "dev", "c" * 40])
def test_missing_offline_is_one_line_naming_id_and_cache(hub_cache: Path, tiny_repo,
                                                         revision) -> None:
    model = "org/tiny" if revision else "org/absent"
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache") as exc:
        resolve_model(model, revision=revision)
    assert_one_line(exc)
    assert model in str(exc.value) and str(hub_cache) in str(exc.value)


def test_bin_only_repository_is_refused(hub_cache: Path, tmp_path: Path) -> None:
    files = tmp_path / "bin-only"
    files.mkdir()
    (files / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (files / "pytorch_model.bin").write_bytes(b"a pickle")
    add_to_cache(hub_cache, "org/pickled", files, NEW)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model\.bin.*never "
                                              r"\*\.bin") as exc:
        resolve_model("org/pickled")
    assert_one_line(exc)
    # Random weights need no checkpoint: config and tokenizer are enough.
    assert resolve_model("org/pickled", require_weights=False).origin == "hub-cache"


@pytest.mark.slow
def test_gguf_inside_a_repository(hub_cache: Path, tmp_path: Path, default_model_source,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Both spellings find the GGUF in the snapshot; its conversion (made by the
    default_model_source fixture, in the same pagedserve cache) is reused."""
    gguf = loader.default_model_path()
    files = tmp_path / "gguf-repo"
    files.mkdir()
    (files / gguf.name).symlink_to(gguf)
    add_to_cache(hub_cache, "org/smol-gguf", files, NEW)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(default_model_source.path.parent.parent))
    by_path = resolve_model(f"org/smol-gguf/{gguf.name}")
    by_flag = resolve_model("org/smol-gguf", gguf_file=gguf.name)
    assert by_path == by_flag
    assert (by_path.path, by_path.gguf) == (default_model_source.path, True)
    assert by_path.origin == "hub-cache, gguf-cache"
    with pytest.raises(ModelLoadError, match="no config.json.*--gguf-file"):
        resolve_model("org/smol-gguf")
    with pytest.raises(ModelLoadError, match="leave out --gguf-file"):
        resolve_model(f"org/smol-gguf/{gguf.name}", gguf_file=gguf.name)
    with pytest.raises(ModelLoadError, match="has no file other.gguf"):
        resolve_model("org/smol-gguf", gguf_file="other.gguf")


def test_revision_and_gguf_file_need_a_hub_id(tmp_path: Path, two_models) -> None:
    old, _ = two_models
    for kwargs in ({"revision": "main"}, {"gguf_file": "x.gguf"}):
        with pytest.raises(ModelLoadError, match="apply to Hugging Face model ids"):
            resolve_model(old, **kwargs)


# ---- the online path, with snapshot_download replaced ---------------------------------------
REMOTE = {  # a repository as they come: HF shards and their index, plus formats we never read
    "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}),
    "generation_config.json": "{}",
    "tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
    "chat_template.jinja": "{{ messages }}",
    "model.safetensors.index.json": json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}),
    "model-00001-of-00002.safetensors": "1", "model-00002-of-00002.safetensors": "2",
    "consolidated.safetensors": "a second copy of the weights",
    "pytorch_model.bin": "pickle", "pytorch_model.bin.index.json": "{}",
    "original/consolidated.00.pth": "pickle", "model.Q4_0.gguf": "gguf", "flax_model.msgpack": "x",
    "README.md": "# card",
}


class FakeHub:
    """``snapshot_download``: writes the remote files the patterns match (matched by
    huggingface_hub's own filter) into the cache, and records every call's patterns."""

    def __init__(self, cache: Path, remote: dict[str, str]) -> None:
        self.cache, self.remote, self.calls, self.revisions = cache, remote, [], []

    def __call__(self, repo_id: str, *, revision: str | None, allow_patterns: list[str]) -> str:
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append(list(allow_patterns))
        self.revisions.append(revision)
        snapshot = self.cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / NEW
        for name in filter_repo_objects(self.remote, allow_patterns=allow_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_text(self.remote[name])
        return str(snapshot)

    def fetched(self) -> set[str]:
        from huggingface_hub.utils import filter_repo_objects

        return {name for patterns in self.calls
                for name in filter_repo_objects(self.remote, allow_patterns=patterns)}


def online(hub_cache: Path, monkeypatch: pytest.MonkeyPatch, remote: dict[str, str]) -> FakeHub:
    import huggingface_hub

    fake = FakeHub(hub_cache, remote)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake


def test_download_fetches_config_tokenizer_and_indexed_shards_only(
        hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = online(hub_cache, monkeypatch, REMOTE)
    source = resolve_model("org/sharded")
    assert (source.name, source.origin) == ("org/sharded", "hub-download")
    assert fake.revisions == [None, NEW]  # the weights at the commit the metadata came from
    assert fake.fetched() == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert [p.name for p in loader._weight_files(source.path)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # Asked again, everything is in the cache.
    assert resolve_model("org/sharded").origin == "hub-cache"


def test_download_without_index_takes_every_safetensors_and_no_other_format(
        hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = {k: v for k, v in REMOTE.items()
              if k not in ("model-00002-of-00002.safetensors", "model.safetensors.index.json")}
    fake = online(hub_cache, monkeypatch, remote)
    resolve_model("org/single")
    weights = {n for n in fake.fetched() if n not in {"config.json", "generation_config.json",
                                                      "chat_template.jinja"}
               and not n.startswith(("tokenizer", "special"))}
    assert weights == {"model-00001-of-00002.safetensors", "consolidated.safetensors"}


def test_dummy_weights_download_no_weights(hub_cache: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake = online(hub_cache, monkeypatch, REMOTE)
    resolve_model("org/sharded", require_weights=False)
    assert not any(name.endswith((".safetensors", ".bin", ".pth", ".gguf"))
                   for name in fake.fetched())


def test_a_bin_only_repository_downloads_nothing_and_is_refused(
        hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = {k: v for k, v in REMOTE.items() if "safetensors" not in k}
    fake = online(hub_cache, monkeypatch, remote)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        resolve_model("org/pickled")
    assert all(n.endswith((".json", ".jinja")) for n in fake.fetched())


def test_hub_gguf_downloads_that_file_alone(hub_cache: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    fake = online(hub_cache, monkeypatch, REMOTE)
    with pytest.raises(ModelLoadError):  # the fake's bytes are no GGUF; only the fetch matters
        resolve_model("org/sharded/model.Q4_0.gguf")
    assert fake.fetched() == {"model.Q4_0.gguf"}


@pytest.mark.parametrize("error, message", [
    ("RepositoryNotFoundError", "no model org/x on the hub (a private or gated one needs "
                                "HF_TOKEN), and none in the cache {cache}"),
    ("GatedRepoError", "no model org/x on the hub (a private or gated one needs HF_TOKEN)"),
    ("RevisionNotFoundError", "org/x has no revision 'v9' on the hub"),
    ("HfHubHTTPError", "cannot fetch org/x@v9 from the Hugging Face hub: 500 boom"),
])
def test_hub_errors_become_one_line(hub_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                    error: str, message: str) -> None:
    import huggingface_hub
    from huggingface_hub import errors

    def refuse(*args, **kwargs):
        # Made without the HTTP response their constructors want: only the type and text matter.
        exc = getattr(errors, error).__new__(getattr(errors, error))
        Exception.__init__(exc, "500 boom\nrequest id: 1")
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("org/x", revision="v9")
    assert_one_line(exc)
    assert str(exc.value).startswith(message.format(cache=hub_cache))


def test_ids_and_paths_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.models.hub import HubModel, parse_model_id

    assert parse_model_id("org/name", "v2", None) == HubModel("org/name", "v2", None)
    assert parse_model_id("org/name/sub/f.GGUF", None, None) == HubModel(
        "org/name", None, "sub/f.GGUF")
    for not_an_id in ("name", "./name", "/abs/path", "org/name/weights.bin", "org/-x",
                      "org/a..b", "a/b--c", "org/name."):
        assert parse_model_id(not_an_id, None, None) is None, not_an_id
    # A local folder wins over an id of the same spelling.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(write_tiny_model(tmp_path / "src", "qwen2"), tmp_path / "org" / "name")
    assert resolve_model("org/name").origin == "hf-folder"

"""Hugging Face model ids -> files in the hub's local cache, fetching only what we load.

An id is ``org/name`` (a repository of safetensors weights) or ``org/name/FILE.gguf`` (one GGUF
inside a repository; ``--gguf-file FILE.gguf`` says the same). ``huggingface_hub`` owns the
cache (``HF_HOME``, ``HF_HUB_CACHE``), the token (``HF_TOKEN``) and offline mode: with
``HF_HUB_OFFLINE=1``, or when the hub cannot be reached, a revision resolves through the cache's
``refs/`` and ``snapshots/`` alone. Only config, generation config, tokenizer files,
sentence-transformers' pooling settings and safetensors weights are fetched (the shards an
index names, when there is one), so a repository that also holds ``*.bin``, ``*.pt`` or
consolidated copies costs no extra download.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
# transformers' tokenizer files of each kind (fast, sentencepiece, BPE vocab and merges, a
# chat template saved apart).
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json",
)
# sentence-transformers' module list and its Pooling module's settings (pooling defaults).
_POOLING_FILES = ("modules.json", "*_Pooling/config.json")
# Everything the loader reads besides weights.
_METADATA_FILES = ("config.json", "generation_config.json", *_TOKENIZER_FILES, INDEX_FILE,
                   *_POOLING_FILES)
_SAFETENSORS = "*.safetensors"
# Weight formats never read (pickles, other runtimes): named when a repository has only these.
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf")
_NAME = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?"  # as the hub allows: no leading or trailing . or -
_REPO_ID = re.compile(f"{_NAME}/{_NAME}")


class HubError(ValueError):
    """The model id cannot be resolved; the one-line message names the id and what to do."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str  # org/name
    revision: str | None  # branch, tag or commit hash; None: the hub's default branch
    gguf_file: str | None  # a GGUF inside the repository, or None for its safetensors

    @property
    def label(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{at}" + (f"/{self.gguf_file}" if self.gguf_file else "")


@dataclass(frozen=True)
class HubFetch:
    path: Path  # the snapshot folder, or the GGUF file inside it
    downloaded: bool  # whether any file came from the network this time


def parse_model_id(model: str, revision: str | None, gguf_file: str | None) -> HubModel | None:
    """``org/name`` or ``org/name/FILE.gguf`` as a hub reference; None if ``model`` is not
    shaped like one (the caller then reports a missing local path)."""
    parts = model.split("/", 2)
    repo_id = "/".join(parts[:2])
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id:
        return None
    if len(parts) == 3:
        if not parts[2].lower().endswith(".gguf"):
            return None
        if gguf_file is not None:
            raise HubError(f"{model} already names a GGUF file; leave out --gguf-file")
        gguf_file = parts[2]
    return HubModel(repo_id, revision, gguf_file)


def fetch(ref: HubModel, with_weights: bool) -> HubFetch:
    """The local path of ``ref``, from the cache or downloaded into it. ``with_weights=False``
    (``--load-format dummy``) fetches config and tokenizer only."""
    from huggingface_hub import constants

    repo_dir = Path(constants.HF_HUB_CACHE) / ("models--" + ref.repo_id.replace("/", "--"))
    before = _snapshot_files(repo_dir)
    if ref.gguf_file is not None:
        path = download(ref, [ref.gguf_file]) / ref.gguf_file
        if not path.is_file():
            raise HubError(f"{ref.label}: the repository has no file {ref.gguf_file}")
    else:
        path = download(ref, list(_METADATA_FILES))
        if not (path / "config.json").is_file():
            raise HubError(f"{ref.label} has no config.json (for a GGUF repository, pass "
                           "--gguf-file NAME.gguf)")
        if with_weights:
            # At the commit just fetched, so a push in between cannot split the snapshot.
            at_commit = dataclasses.replace(ref, revision=path.name)
            download(at_commit, [*_METADATA_FILES, *_weight_patterns(path)])
            _require_safetensors(ref, path)
    return HubFetch(path, downloaded=bool(_snapshot_files(repo_dir) - before))


def fetch_tokenizer(ref: HubModel) -> Path:
    """The snapshot folder of ``ref``'s tokenizer files (``--tokenizer``), from the cache or
    downloaded into it; a tokenizer repository needs no config or weights."""
    return download(ref, list(_TOKENIZER_FILES))


def snapshot_repo_id(folder: Path) -> str | None:
    """``org/name`` for a snapshot folder of the hub cache (``models--org--name/snapshots/C``),
    whose own name, a commit hash, says nothing; None for any other folder."""
    parts = folder.absolute().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    return parts[-3].removeprefix("models--").replace("--", "/", 1)


def _weight_patterns(snapshot: Path) -> list[str]:
    """The shards an index names, else every safetensors file (never other formats)."""
    index = snapshot / INDEX_FILE
    if not index.is_file():
        return [_SAFETENSORS]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError) as exc:
        raise HubError(f"cannot read {index}: {exc}") from exc


def download(ref: HubModel, patterns: list[str]) -> Path:
    """The snapshot folder of ``ref`` with its files matching ``patterns``, from the cache or
    downloaded into it; ``HubError`` with a one-line reason otherwise."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision,
                                      allow_patterns=patterns))
    except RevisionNotFoundError as exc:
        raise HubError(f"{ref.repo_id} has no revision {ref.revision!r} on the hub") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(f"no model {ref.repo_id} on the hub (a private or gated one needs "
                       f"HF_TOKEN), and none in the cache {constants.HF_HUB_CACHE}") from exc
    except LocalEntryNotFoundError as exc:
        raise HubError(
            f"model {ref.label} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and "
            "the hub cannot be reached (HF_HUB_OFFLINE=1 or no network); download it once "
            "online, or point HF_HUB_CACHE at a cache that holds it") from exc
    except (OSError, ValueError) as exc:  # HTTP errors, bad ids, a full disk
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HubError(f"cannot fetch {ref.label} from the Hugging Face hub: {first_line}") \
            from exc


def _require_safetensors(ref: HubModel, snapshot: Path) -> None:
    if any(snapshot.glob(_SAFETENSORS)):
        return
    others = sorted({p.name for pattern in _OTHER_WEIGHTS for p in snapshot.glob(pattern)})
    found = f" (it holds {', '.join(others)})" if others else ""
    hint = "; pass --gguf-file NAME.gguf for its GGUF" if any(
        name.endswith(".gguf") for name in others) else ""
    raise HubError(
        f"{ref.label} has no *.safetensors weights{found}: pagedserve loads safetensors only, "
        f"never *.bin or *.pt pickles{hint}")


def _snapshot_files(repo_dir: Path) -> set[Path]:
    """Every file under the repository's snapshots (links into its blobs)."""
    return set((repo_dir / "snapshots").rglob("*"))

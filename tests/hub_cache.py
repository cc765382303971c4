"""A Hugging Face hub cache written by hand, in huggingface_hub's on-disk layout:
``models--ORG--NAME/{blobs,refs,snapshots/COMMIT}``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

OLD, NEW = "a" * 40, "b" * 40  # commit hashes


def offline_cache(tmp_path: Path, monkeypatch) -> Path:
    """An empty hub cache under ``tmp_path``, offline. huggingface_hub reads its environment at
    import, so its constants are set too."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def add_to_cache(cache: Path, repo_id: str, files: Path, commit: str,
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Store ``files`` as commit ``commit`` of ``repo_id``: each file a blob named by its hash,
    the snapshot's entries relative links to the blobs, each ref a file holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for f in sorted(p for p in files.iterdir() if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot

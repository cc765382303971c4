"""Fixtures shared across the test tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run under Triton's interpreter, which must be chosen
    # before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.models.loader import resolve_model


@pytest.fixture(scope="session")
def default_model_folder(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """The default SmolLM2 GGUF as a Hugging Face folder.

    Converted into pytest's own cache (``.pytest_cache/d/pagedserve``), not the user's, so only
    the first run pays for the conversion and ``pytest --cache-clear`` starts over.
    """
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    root = cache.mkdir("pagedserve") if cache else tmp_path_factory.mktemp("pagedserve")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(root))
        return resolve_model(None).path

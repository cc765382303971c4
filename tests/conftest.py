"""Fixtures shared across the test tree.

Every test process runs torch on one thread (``OMP_NUM_THREADS``, inherited by the server
subprocesses); parallelism comes from pytest-xdist workers (``make test`` runs ``-n 2``). With
two threads each on a 2-core machine where other test runs were busy, torch's OpenMP threads
spun against each other: the default-model tests used 124 CPU-seconds, against 30 on one
thread. Set the variable yourself to run with more.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing in the suite touches the network: a Hugging Face model id resolves through the hub
# cache alone (huggingface_hub reads this once, at import; server subprocesses inherit it).
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.devices import HAS_NVIDIA  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not HAS_NVIDIA:
    # Without an NVIDIA GPU (on ROCm too) the Triton kernel tests run under Triton's
    # interpreter, which must be chosen before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.models.loader import ModelSource, resolve_model  # noqa: E402
from tests.tiny_models import hf_model_of_source, write_tiny_model  # noqa: E402


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``-n N`` (xdist's default ``--dist load``) hand out whole test files, as
    ``--dist loadfile`` does, and all of tests/server/ as one unit: a file's module fixtures and
    the server subprocesses, which take seconds to start, are then built by one worker only.
    The files that start local Ray clusters are one unit too: two clusters started at once on
    one machine hung a worker in ``ray.init`` (its GCS client never connected).
    (``--dist loadgroup`` would say this with markers, but cannot regroup tests under pytest 9.2:
    pytest-xdist 3.8 renames node ids through an attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in _RAY_FILES:
                return "ray"
            return "tests/server/" if path.startswith("tests/server/") \
                and path not in _OWN_SERVERS else path

    return FileScheduling(config, log)


# Server test files that start servers of their own (and kill them): no shared fixture keeps
# them on the worker that runs the shared servers.
_OWN_SERVERS = {"tests/server/test_engine_core_process.py", "tests/server/test_server_hub.py"}

# Test files whose engines start a local Ray cluster (distributed_executor_backend="ray").
_RAY_FILES = {"tests/executor/test_tensor_parallel.py", "tests/entrypoints/test_llm_lifecycle.py"}

RUN_ID = pytest.StashKey[str]()


def _test_run_id(config: pytest.Config) -> str:
    """One id for a whole test run, shared by its xdist workers."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return workerinput["testrunuid"]
    return config.stash.setdefault(RUN_ID, uuid.uuid4().hex)


@pytest.fixture(scope="session")
def default_model_source(request: pytest.FixtureRequest, tmp_path_factory) -> ModelSource:
    """The default SmolLM2 GGUF as a Hugging Face folder.

    Converted into pytest's own cache (``.pytest_cache/d/pagedserve``), not the user's, so only
    the first run pays for the conversion and ``pytest --cache-clear`` starts over. A file lock
    keeps concurrent test processes (xdist workers) from converting it twice. The origin is
    ``gguf-converted`` whenever this test run did the conversion, in whichever process did it,
    so tests/models/test_gguf_convert.py can check that conversion instead of making another.
    """
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    root = cache.mkdir("pagedserve") if cache else tmp_path_factory.mktemp("pagedserve")
    run, record = _test_run_id(request.config), root / "converted-by-run.json"
    with (root / ".lock").open("w") as lock, pytest.MonkeyPatch.context() as mp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(root))
        source = resolve_model(None)
        if source.origin == "gguf-converted":
            record.write_text(json.dumps({"run": run}))
        elif record.is_file() and json.loads(record.read_text())["run"] == run:
            source = dataclasses.replace(source, origin="gguf-converted")
        return source


@pytest.fixture(scope="session")
def default_model_folder(default_model_source: ModelSource) -> Path:
    return default_model_source.path


@pytest.fixture(scope="session")
def default_llm(default_model_folder: Path):
    """One engine on the default model for the whole session. Tests finish every request they
    add and use greedy or per-request seeded sampling, so none depends on another's leftovers."""
    from pagedserve import LLM

    return LLM(model=str(default_model_folder), device="cpu", kv_cache_memory_bytes=256 << 20,
               quantization="none")


@pytest.fixture(scope="session")
def default_hf_model(default_model_source: ModelSource):
    """transformers' model holding the default model's dequantized weights (the GGUF blocks
    unpack exactly as the gguf package dequantizes them: tests/quant/test_gguf_blocks.py)."""
    return hf_model_of_source(default_model_source)


@pytest.fixture(params=["native", "int4pack"])
def cpu_quant_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on each CPU kernel for grouped 4/8-bit weights (the native one, and torch's
    int4pack where no C compiler works); returns the linear method's class name."""
    from pagedserve.platforms.cpu import native_quant

    if request.param == "int4pack":
        monkeypatch.setattr(native_quant, "available", lambda: False)
    return {"native": "NativeQuantLinearMethod", "int4pack": "Int4PackLinearMethod"}[
        request.param]


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> Callable[[str], Path]:
    """``tiny_model_folder("qwen2")``: that architecture's random-weight checkpoint (see
    ``tests/tiny_models.py``), written once per session. Shared: tests must not change it."""
    folders: dict[str, Path] = {}

    def folder(arch: str) -> Path:
        if arch not in folders:
            folders[arch] = write_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return folders[arch]

    return folder


@pytest.fixture(scope="session")
def llama3_folder(tiny_model_folder) -> Path:
    """The random-weight Llama-3-shaped checkpoint most engine tests run on."""
    return tiny_model_folder("llama3")

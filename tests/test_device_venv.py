"""scripts/device_venv.sh, as ``make serve DEVICE=cuda`` runs it on a machine whose python
already has torch, offline: the venv sees that torch (here the test run's own, which lives in a
virtualenv, the case --system-site-packages alone misses), installs none, and gets pagedserve."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_venv_on_this_pythons_torch_offline(tmp_path: Path) -> None:
    venv, wheels = tmp_path / "venv", tmp_path / "wheels"
    wheels.mkdir()  # empty: every package must come from this python's environment
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, WHEELS=str(wheels), TORCH="", TORCH_PIN="torch==0.0.0",
               ROCM_INDEX="unused")
    subprocess.run(["bash", "scripts/device_venv.sh", "cuda", str(venv)], cwd=ROOT, env=env,
                   check=True, timeout=600, capture_output=True)
    probe = ("import sysconfig, torch, pagedserve; print(torch.__file__); "
             "print(pagedserve.__file__); print(sysconfig.get_path('purelib'))")
    lines = subprocess.run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, env=env,
                           check=True, capture_output=True, text=True).stdout.split()
    assert lines[0] == torch.__file__  # this python's torch, not a new one
    assert Path(lines[1]).is_relative_to(ROOT / "pagedserve")  # editable, this checkout
    purelib = Path(lines[2])
    assert purelib != Path(sysconfig.get_path("purelib"))
    assert not list(purelib.glob("torch*"))
    assert (venv / "bin" / "pagedserve").is_file()


def test_hpu_without_gaudis_torch_stops_with_a_message(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "TORCH": ""}
    done = subprocess.run(["bash", "scripts/device_venv.sh", "hpu", str(tmp_path / "v")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "needs Intel Gaudi's PyTorch (habana_frameworks.torch)" in done.stderr
    assert not (tmp_path / "v").exists()

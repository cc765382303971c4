"""``pagedserve bench step-overhead --breakdown``: each row splits its step into the named
parts, the engine's own glue included."""

from __future__ import annotations

import json

from pagedserve.cli import build_parser


def test_breakdown_reports_every_part_of_each_row(tmp_path):
    from pagedserve.bench import step_overhead

    out = tmp_path / "step_overhead.json"
    step_overhead.main(build_parser().parse_args([
        "bench", "step-overhead", "--device", "cpu", "--batch-sizes", "2", "3", "--steps", "3",
        "--breakdown", "--out", str(out)]))
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 3]
    parts = {"schedule_us", "pack_us", "forward_us", "sample_us", "fetch_us", "output_us",
             "other_host_us"}
    assert all(parts <= r.keys() for r in rows)

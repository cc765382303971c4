"""``bench/device_timeline.py``: the union and gaps of device intervals against a brute-force
count over a microsecond grid; on a GPU, a run's report against the kernels it launched."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.bench.device_timeline import LONG_GAP_US, busy_and_gaps
from tests.devices import HAS_NVIDIA, NVIDIA_REASON


def grid_reference(intervals: list[tuple[int, int]]) -> dict:
    """Every microsecond of the span marked busy or idle; gaps as runs of idle ones. Empty
    intervals mark nothing."""
    intervals = [(s, e) for s, e in intervals if e > s]
    if not intervals:
        return {"device_busy_s": 0.0, "device_idle_s": 0.0, "idle_in_long_gaps_s": 0.0,
                "long_gaps": 0}
    first = min(s for s, _ in intervals)
    last = max(e for _, e in intervals)
    busy = [False] * (last - first)
    for s, e in intervals:
        for t in range(s, e):
            busy[t - first] = True
    gaps, run = [], 0
    for b in busy + [True]:
        if b:
            if run:
                gaps.append(run)
            run = 0
        else:
            run += 1
    return {"device_busy_s": sum(busy) / 1e6, "device_idle_s": sum(gaps) / 1e6,
            "idle_in_long_gaps_s": sum(g for g in gaps if g >= LONG_GAP_US) / 1e6,
            "long_gaps": sum(g >= LONG_GAP_US for g in gaps)}


@pytest.mark.parametrize("seed", range(40))
def test_busy_and_gaps_match_a_grid_count(seed):
    rng = random.Random(seed)
    intervals = []
    for _ in range(rng.randint(1, 40)):  # nested, overlapping, touching and far apart
        start = rng.randint(0, 8000)
        intervals.append((start, start + rng.choice([0, 1, 5, 300, 1500])))
    got = busy_and_gaps(rng.sample(intervals, len(intervals)))
    expected = grid_reference(intervals)
    assert got["long_gaps"] == expected["long_gaps"]
    for key in ("device_busy_s", "device_idle_s", "idle_in_long_gaps_s"):
        assert got[key] == pytest.approx(expected[key], abs=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)
def test_timeline_of_a_run_with_a_long_pause():
    """Two bursts of matmuls with a host sleep of 20 ms between them: busy about the bursts'
    kernel time, one long gap of at least the sleep, the matmul kernel on top."""
    import time

    from pagedserve.bench.device_timeline import device_timeline

    a = torch.randn(2048, 2048, device="cuda")

    def run():
        for _ in range(2):
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
            time.sleep(0.02)

    report = device_timeline(run)
    assert report["long_gaps"] >= 1 and report["idle_in_long_gaps_s"] >= 0.018
    top = report["top_kernels"][0]
    assert top["calls"] == 40
    assert report["device_busy_s"] == pytest.approx(
        sum(k["seconds"] for k in report["top_kernels"]), rel=0.05)

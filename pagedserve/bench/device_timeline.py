"""How busy the device was over a whole run, from torch.profiler's record of its kernels and
copies: their intervals merged (busy), what lies between them (idle), the idle time in gaps
of a millisecond or more, and the kernels that took the most time.

A run whose kernels got faster but whose wall time did not is bound elsewhere: by the host,
or by gaps between steps. ``bench throughput --device-timeline`` runs its workload a second
time (fresh prompts, so the prefix cache does not shorten it) under the profiler and reports
these next to the timed run; the profiler slows the host, so the idle time is an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# Gaps of at least this many microseconds are counted apart: a step's host work or a stall,
# rather than a launch's latency.
LONG_GAP_US = 1000.0


def busy_and_gaps(intervals: Iterable[tuple[float, float]]) -> dict:
    """``intervals`` (start, end) in microseconds, in any order and overlapping (streams):
    seconds busy (their union), idle between the first start and the last end, and idle in
    gaps of at least LONG_GAP_US, with their count. Empty intervals (no duration) count as
    nothing: they neither add busy time nor split a gap."""
    busy = idle = long_idle = 0.0
    long_gaps = 0
    end = None
    for start, stop in sorted(i for i in intervals if i[1] > i[0]):
        if end is None:
            busy, end = stop - start, stop
            continue
        if start > end:
            gap = start - end
            idle += gap
            if gap >= LONG_GAP_US:
                long_idle += gap
                long_gaps += 1
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return {"device_busy_s": busy / 1e6, "device_idle_s": idle / 1e6,
            "idle_in_long_gaps_s": long_idle / 1e6, "long_gaps": long_gaps}


def device_timeline(run: Callable[[], object], top: int = 12) -> dict:
    """``run()`` under the profiler: ``busy_and_gaps`` of the device's events and the ``top``
    kernels by total time (name, seconds, calls). Needs a CUDA (or ROCm) device."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    totals: dict[str, list[float]] = {}
    for e in events:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us() / 1e6
        entry[1] += 1
    kernels = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return {**busy_and_gaps((e.time_range.start, e.time_range.end) for e in events),
            "top_kernels": [{"name": name, "seconds": s, "calls": n}
                            for name, (s, n) in kernels]}

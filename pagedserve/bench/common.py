"""Shared pieces of the benchmarks: workloads, timing, result tables and JSON files."""

from __future__ import annotations

import json
import platform as host_platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path("benchmarks/results")


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


def random_workload(num: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, avoid: set[int], seed: int) -> list[WorkItem]:
    """Prompts of random ordinary tokens (special tokens excluded) with uniform lengths."""
    rng = random.Random(seed)
    pool = [t for t in range(vocab_size) if t not in avoid]
    return [
        WorkItem([rng.choice(pool) for _ in range(rng.randint(*input_range))],
                 rng.randint(*output_range))
        for _ in range(num)
    ]


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def seconds_per_step(engine, steps: int) -> float:
    """Mean wall seconds of the engine's next ``steps`` steps, the device drained before and
    after (what was queued before does not count, what they queued does)."""
    engine.platform.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.platform.synchronize()
    return (time.perf_counter() - start) / steps


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


def write_result(name: str, payload: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "host": host_platform.node(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path

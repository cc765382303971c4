"""Where a prefill-heavy CPU step's time goes: the default model prefills 8 prompts of 512
tokens (after a warm-up batch of other prompts, so nothing comes from the prefix cache) under
torch.profiler, with a wall clock around the attention backend's ``forward`` (its KV writes
included). Prints the wall time, attention's share and the top torch ops by self CPU time; the
native C kernels (matmuls, layer ops, attention) are ctypes calls, not torch ops, so they show
only in the wall and attention times.

    .venv/bin/python scripts/profile_cpu_prefill.py [--rows N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.platforms.cpu import attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10)
    args = parser.parse_args()
    seconds = [0.0]
    forward = attention.CpuPagedAttention.forward

    def timed(self, *a):
        start = time.perf_counter()
        out = forward(self, *a)
        seconds[0] += time.perf_counter() - start
        return out

    attention.CpuPagedAttention.forward = timed
    engine = LLM(device="cpu").engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

    def prefill(base: int) -> None:
        for i in range(8):
            engine.add_request([(base + i * 31 + j) % 4000 + 10 for j in range(512)], params)

    prefill(0)
    while engine.has_unfinished_requests():
        engine.step()
    prefill(997)
    seconds[0], steps = 0.0, 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    print(f"{steps} steps, {wall:.3f} s profiled, attention forward {seconds[0]:.3f} s "
          f"({seconds[0] / wall:.1%})")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

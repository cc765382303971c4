"""Where a step's device time goes: torch.profiler over decode and prefill steps of a real
model shape with random weights. Prints the top kernels by device time for each case, and the
wall time of the steps against the device's busy time (the sum of its kernels' times): where
busy is well below wall, the device waited for the host.

    python scripts/profile_step.py --shape llama3-8b --device cuda [--graphs]

Steps run eagerly (one row per kernel) unless ``--graphs``, which replays the decode steps'
CUDA graphs as the engine does by default (their kernels still show). With ``--lora-adapters
N`` (and ``--enable-lora --max-lora-rank R``) the requests take turns over N random adapters of
rank R on all seven projections, so the LoRA kernels' share of a step shows. With ``--eagle3
K`` a random EAGLE-3 head of the shape drafts K tokens for a batch-1 stream every step (all
verified, whatever they score), and the host's Python of those steps is profiled too.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def profiled_steps(engine, label: str, steps: int, rows: int, timed: bool = True) -> None:
    """``timed``: first time ``steps`` steps without the profiler (steps that must be like the
    profiled ones: decode steps)."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # Wall time without the profiler (which slows the host), then the same number of steps
    # profiled.
    engine.platform.synchronize()
    start = time.perf_counter()
    for _ in range(steps if timed else 0):
        engine.step()
    engine.platform.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        engine.platform.synchronize()
    events = prof.key_averages()
    # Kernels and copies only: an operator's row repeats its kernels' time.
    busy_ms = sum(e.self_device_time_total for e in events
                  if e.device_type == DeviceType.CUDA) / 1e3 / steps
    wall = f"wall {wall_ms:.2f} ms a step unprofiled, " if timed else ""
    print(f"\n=== {label}: {steps} steps, {wall}device busy {busy_ms:.2f} ms a step"
          + (f" ({busy_ms / wall_ms:.0%})" if timed else ""))
    print(events.table(sort_by="self_device_time_total", row_limit=rows))


def add_requests(engine, num: int, prompt_len: int, max_tokens: int, loras: list) -> None:
    """``num`` requests, request ``i`` on adapter ``loras[i % len]`` (the base model without
    adapters)."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False, output_kind="final_only")
    for i in range(num):
        engine.add_request([(i * 31 + j) % 400 + 10 for j in range(prompt_len)], params,
                           lora_request=loras[i % len(loras)] if loras else None)


def main() -> None:
    from pagedserve.bench import throughput

    parser = argparse.ArgumentParser()
    throughput.add_args(parser)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--graphs", action="store_true",
                        help="replay CUDA graphs for decode steps (default: eager)")
    parser.add_argument("--lora-adapters", type=int, default=0,
                        help="requests over this many random adapters (needs --enable-lora)")
    parser.add_argument("--eagle3", type=int, default=0, metavar="K",
                        help="a random EAGLE-3 head drafting K tokens a step (batch 1 only)")
    args = parser.parse_args()
    args.enforce_eager = not args.graphs
    if args.eagle3:
        return profile_eagle3(args)
    engine = throughput.engine_from_args(args).engine
    with tempfile.TemporaryDirectory(prefix="pagedserve-profile-") as folder:
        loras = []
        if args.lora_adapters:
            from pagedserve.bench.random_adapters import write_random_adapters

            loras = write_random_adapters(Path(folder), engine.arch, args.lora_adapters,
                                          args.max_lora_rank, engine.dtype,
                                          engine.platform.device(), args.seed)
        profile_cases(engine, args.rows, loras)


def profile_cases(engine, rows: int, loras: list) -> None:
    add_requests(engine, 1, 512, 40, loras)
    for _ in range(8):
        engine.step()
    profiled_steps(engine, "decode, batch 1, context ~520", 8, rows)
    while engine.has_unfinished_requests():
        engine.step()

    add_requests(engine, 64, 128, 3, loras)
    profiled_steps(engine, "prefill, 64 x 128 tokens in one step", 1, rows, timed=False)
    while engine.has_unfinished_requests():
        engine.step()

    add_requests(engine, 1000, 128, 16, loras)
    while engine.stats().num_waiting:
        engine.step()
    engine.step()
    profiled_steps(engine, "decode, batch 1000, context ~140", 4, rows)
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            engine.step()


def profile_eagle3(args) -> None:
    import cProfile
    import json
    import pstats

    from pagedserve.bench import speculative, throughput
    from pagedserve.bench.dummy_model import write_dummy_eagle3_folder

    head = write_dummy_eagle3_folder(args.shape, Path(tempfile.mkdtemp()))
    args.speculative_config = json.dumps({"method": "eagle3", "model": str(head),
                                          "num_speculative_tokens": args.eagle3})
    engine = throughput.engine_from_args(args).engine
    engine.speculation.step_times = speculative._FreeDrafts()
    engine.speculation.acceptance = speculative._SureAcceptance()
    engine.speculation.proposer = speculative._DraftSlots(args.eagle3)
    add_requests(engine, 1, 512, 400, [])
    for _ in range(8):
        engine.step()
    profiled_steps(engine, f"EAGLE-3 verify, k={args.eagle3}, batch 1, context ~520", 8,
                   args.rows)
    with cProfile.Profile() as host:
        for _ in range(20):
            engine.step()
    print("\n=== the host's Python over 20 of those steps (cProfile slows it: shares only)")
    pstats.Stats(host).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()

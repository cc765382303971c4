"""Where a step's device time goes: torch.profiler over eager decode and prefill steps of a real
model shape with random weights. Prints the top kernels by device time for each case.

    python scripts/profile_step.py --shape llama3-8b --device cuda
"""

from __future__ import annotations

import argparse

import torch


def profiled_steps(engine, label: str, steps: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine.platform.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        engine.platform.synchronize()
    print(f"\n=== {label}: {steps} steps")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows))


def add_requests(engine, num: int, prompt_len: int, max_tokens: int) -> None:
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False, output_kind="final_only")
    for i in range(num):
        engine.add_request([(i * 31 + j) % 400 + 10 for j in range(prompt_len)], params)


def main() -> None:
    from pagedserve.bench import throughput

    parser = argparse.ArgumentParser()
    throughput.add_args(parser)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    args.enforce_eager = True
    engine = throughput.engine_from_args(args).engine

    add_requests(engine, 1, 512, 40)
    for _ in range(8):
        engine.step()
    profiled_steps(engine, "decode, batch 1, context ~520", 8, args.rows)
    while engine.has_unfinished_requests():
        engine.step()

    add_requests(engine, 64, 128, 3)
    profiled_steps(engine, "prefill, 64 x 128 tokens in one step", 1, args.rows)
    while engine.has_unfinished_requests():
        engine.step()

    add_requests(engine, 1000, 128, 12)
    while engine.stats().num_waiting:
        engine.step()
    engine.step()
    profiled_steps(engine, "decode, batch 1000, context ~140", 4, args.rows)
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()

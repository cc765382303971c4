"""``pagedserve bench step-overhead``: the engine's host-side cost per sequence per decode step.

A compute-free model shape (``tiny-llama``) runs many greedy streams, so a step's time is
almost all scheduling, input packing, sampling bookkeeping and output handling: the part that
runs serialized with the GPU step and caps decode throughput at large batches.
"""

from __future__ import annotations

import argparse
import time


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--shape", default="tiny-llama")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", default=None)


def time_steps(engine, batch: int, steps: int) -> float:
    """Mean seconds per step once every stream is decoding."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                            detokenize=False, output_kind="final_only")
    for i in range(batch):
        engine.add_request([(i * 7 + j) % 500 + 3 for j in range(32)], params)
    engine.step()  # every prompt prefills in this first step
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        count += 1
    return (time.perf_counter() - start) / count


def main(args: argparse.Namespace) -> None:
    from pagedserve.bench.common import print_table, write_result
    from pagedserve.bench.throughput import engine_from_args

    args.max_num_seqs = max(args.max_num_seqs, *args.batch_sizes)
    args.max_num_batched_tokens = args.max_num_batched_tokens or 32 * args.max_num_seqs
    engine = engine_from_args(args).engine
    rows = []
    for batch in args.batch_sizes:
        step = time_steps(engine, batch, args.steps)
        rows.append({"batch": batch, "step_ms": step * 1e3,
                     "us_per_seq_per_step": step / batch * 1e6})
    print_table(f"host overhead per decode step ({engine.platform.name}, {args.shape})", rows,
                ["batch", "step_ms", "us_per_seq_per_step"])
    write_result(f"step_overhead_{engine.platform.name}", {"shape": args.shape, "rows": rows},
                 args.out)

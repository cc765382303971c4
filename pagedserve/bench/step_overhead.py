"""``pagedserve bench step-overhead``: the engine's host-side cost per sequence per decode step.

A compute-free model shape (``tiny-llama``) runs many greedy streams, so a step's time is
almost all scheduling, input packing, sampling bookkeeping and output handling: the part that
runs serialized with the GPU step and caps decode throughput at large batches.
"""

from __future__ import annotations

import argparse
import time

from pagedserve.arg_types import positive


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--shape", default="tiny-llama")
    parser.add_argument("--batch-sizes", type=positive(int), nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=positive(int), default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--breakdown", action="store_true",
                        help="split each row's time into scheduling, packing the inputs, the "
                             "forward pass, sampling, fetching and output handling")


def step_parts(engine):
    """A ``PhaseTimes`` over the calls of a one-rank step: what is left of a step's time is
    the engine's own glue (first-scheduled times, the sampling inputs, advancing)."""
    from pagedserve.bench.throughput import PhaseTimes

    runner = engine.executor.step.runner
    return PhaseTimes(engine, ((engine.scheduler, "schedule", "schedule_s"),
                               (runner, "plan", "pack_s"), (runner, "forward", "forward_s"),
                               (runner, "sample", "sample_s"), (runner, "fetch", "fetch_s"),
                               (engine.outputs, "process", "output_s")))


def time_steps(engine, batch: int, steps: int, parts=None) -> float:
    """Mean seconds per step once every stream is decoding; ``parts`` (``step_parts``) is
    left holding the mean step's split."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                            detokenize=False, output_kind="final_only")
    for i in range(batch):
        engine.add_request([(i * 7 + j) % 500 + 3 for j in range(32)], params)
    # The first step prefills every prompt but the repeats (request i + 500 has request i's),
    # which start in the next, the first timed one, with their blocks from the prefix cache.
    engine.step()
    if parts is not None:
        parts.totals = dict.fromkeys(parts.totals, 0.0)
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        count += 1
    if parts is not None:
        parts.totals = {key: seconds / count for key, seconds in parts.totals.items()}
    return (time.perf_counter() - start) / count


def main(args: argparse.Namespace) -> None:
    from pagedserve.bench.common import print_table, write_result
    from pagedserve.bench.throughput import engine_from_args

    args.max_num_seqs = max(args.max_num_seqs, *args.batch_sizes)
    args.max_num_batched_tokens = args.max_num_batched_tokens or 32 * args.max_num_seqs
    engine = engine_from_args(args).engine
    parts = step_parts(engine) if args.breakdown else None
    rows = []
    for batch in args.batch_sizes:
        step = time_steps(engine, batch, args.steps, parts)
        rows.append({"batch": batch, "step_ms": step * 1e3,
                     "us_per_seq_per_step": step / batch * 1e6,
                     **(_per_seq(parts, step, batch) if parts else {})})
    print_table(f"host overhead per decode step ({engine.platform.name}, {args.shape})", rows,
                list(rows[0]))
    write_result(f"step_overhead_{engine.platform.name}", {"shape": args.shape, "rows": rows},
                 args.out)


def _per_seq(parts, step_s: float, batch: int) -> dict[str, float]:
    """Each part of the mean step in microseconds per sequence, the engine's glue as
    ``other_host``."""
    return {f"{key.removesuffix('_s')}_us": seconds / batch * 1e6
            for key, seconds in parts.as_dict(step_s).items()}

"""``pagedserve bench long-prefill``: TTFT of a short request that arrives while a long prompt
is mid-prefill, with concurrent partial prefills off (``--max-num-partial-prefills 1``: the
long prompt takes the whole budget every step) and on (as configured, by default 4).

The long prompt runs one step alone, then the short one arrives; both are timed from their
arrival to their first token (the engine's request metrics), in the same process, the two
settings one after the other on the same prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

from pagedserve.arg_types import positive
from pagedserve.bench.common import print_table, random_workload, write_result


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--long-prompt-len", type=positive(int), default=4000)
    parser.add_argument("--short-prompt-len", type=positive(int), default=16)
    parser.add_argument("--short-output-len", type=positive(int), default=4)
    parser.add_argument("--threads", type=positive(int), default=None,
                        help="CPU threads (default: the platform's); 1 keeps the timings "
                             "steady on a host whose cores other work shares")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


def measure(engine, long_prompt: list[int], short_prompt: list[int], output_len: int) -> dict:
    from pagedserve.sampling_params import SamplingParams

    engine.add_request(short_prompt, SamplingParams(max_tokens=1))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    done = {o.request_id: o for o in engine.step() if o.finished}
    short_id = engine.add_request(short_prompt, SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True))
    steps_to_short_token = None
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        done.update((o.request_id, o) for o in outputs if o.finished)
        short_started = any(o.request_id == short_id and o.outputs[0].token_ids
                            for o in outputs)
        if steps_to_short_token is None and short_started:
            steps_to_short_token = num_steps
    short, long = done[short_id].metrics, done[long_id].metrics
    return {"short_ttft_s": short.first_token_time - short.arrival_time,
            "short_steps_to_first_token": steps_to_short_token,
            "short_latency_s": short.finished_time - short.arrival_time,
            "long_ttft_s": long.first_token_time - long.arrival_time}


def main(args: argparse.Namespace) -> None:
    import torch

    from pagedserve.engine_args import config_from_args
    from pagedserve.entrypoints.llm import LLM

    config = config_from_args(args)
    rng = random.Random(args.seed)
    rows, prompts = [], None
    for partial in (1, config.max_num_partial_prefills):
        engine = LLM.from_config(dataclasses.replace(
            config, max_num_partial_prefills=partial,
            max_long_partial_prefills=min(config.max_long_partial_prefills, partial))).engine
        if args.threads:
            torch.set_num_threads(args.threads)  # after the platform set its own count
        if prompts is None:
            avoid = set(engine.tokenizer.all_special_ids)
            prompts = [random_workload(1, (n, n), (1, 1), engine.arch.vocab_size, avoid,
                                       rng.randrange(1 << 30))[0].prompt_token_ids
                       for n in (args.long_prompt_len, args.short_prompt_len)]
        rows.append({"max_num_partial_prefills": partial,
                     "budget": engine.scheduler.config.max_num_batched_tokens,
                     **measure(engine, *prompts, args.short_output_len)})
        engine.shutdown()
    result = {"model": config.model or "default", "device": config.device,
              "threads": torch.get_num_threads(),
              "args": {k: getattr(args, k) for k in ("long_prompt_len", "short_prompt_len",
                                                     "short_output_len")},
              "runs": rows, "short_ttft_speedup": rows[0]["short_ttft_s"]
              / rows[1]["short_ttft_s"]}
    print_table(f"TTFT of a {args.short_prompt_len}-token request arriving one step into a "
                f"{args.long_prompt_len}-token prefill (speed-up "
                f"{result['short_ttft_speedup']:.1f}x)", rows,
                ["max_num_partial_prefills", "budget", "short_ttft_s",
                 "short_steps_to_first_token", "short_latency_s", "long_ttft_s"])
    write_result("long_prefill", result, args.out)

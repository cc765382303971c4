"""``pagedserve bench kv-offload``: TTFT of multi-turn conversations whose prefixes have left
the device pool, without and with the host offloading tier (``--kv-offloading-size``).

Each conversation starts with a prefix of its own; each turn's prompt is the previous prompt,
its answer and a new user message. Turns run one request at a time, conversation after
conversation, so that by the time a conversation returns the device pool (sized to hold
``--device-share`` of all the prefixes) has evicted it. Both runs take the same prompts in
the same process; TTFT is the engine's (arrival to first token). The JSON also records the
blocks the tier copied on eviction against those write-through would have copied (every
committed block), the measurement behind the tier's write-on-eviction policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics

from pagedserve.bench.common import print_table, write_result


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--message-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--device-share", type=float, default=0.25,
                        help="share of all the conversations' prefixes the device pool holds")
    parser.add_argument("--tier-gib", type=float, default=1.0,
                        help="--kv-offloading-size of the run with the tier")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


def run(engine, prefixes: list[list[int]], messages: list[list[list[int]]],
        output_len: int) -> list[dict]:
    """Every turn of every conversation, one request at a time; a row per request."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    history, rows = [list(p) for p in prefixes], []
    for turn, turn_messages in enumerate(messages):
        for c, message in enumerate(turn_messages):
            request_id = engine.add_request(history[c], params)
            done = None
            while engine.has_unfinished_requests():
                done = next((o for o in engine.step() if o.request_id == request_id
                             and o.finished), done)
            m = done.metrics
            rows.append({"turn": turn, "ttft_s": m.first_token_time - m.arrival_time,
                         "cached_tokens": m.num_cached_tokens})
            history[c] += done.outputs[0].token_ids + message
    return rows


def _summary(label: str, rows: list[dict], seconds: float, output_tokens: int, stats) -> dict:
    later = [r["ttft_s"] for r in rows if r["turn"] > 0]
    return {"run": label, "ttft_p50_turn1_s": statistics.median(
                [r["ttft_s"] for r in rows if r["turn"] == 0]),
            "ttft_p50_later_turns_s": statistics.median(later),
            "output_tok_s": output_tokens / seconds, "seconds": seconds,
            "prefix_hit_rate": stats.prefix_hit_rate,
            "host_hit_rate": stats.prefix_hit_rate_of("host"),
            "bytes_to_host": stats.offload_bytes_to_host,
            "bytes_to_device": stats.offload_bytes_to_device,
            "copy_s": stats.offload_copy_s}


def main(args: argparse.Namespace) -> None:
    import time

    from pagedserve.engine_args import config_from_args
    from pagedserve.entrypoints.llm import LLM

    config = config_from_args(args)
    probe = LLM.from_config(dataclasses.replace(config, kv_cache_memory_bytes=1 << 24)).engine
    bytes_per_block, block_size = probe.kv_bytes_per_block, probe.kv.block_size
    vocab = [t for t in range(probe.arch.vocab_size)
             if t not in set(probe.tokenizer.all_special_ids)]
    probe.shutdown()
    rng = random.Random(args.seed)
    prefixes = [rng.choices(vocab, k=args.prefix_len) for _ in range(args.conversations)]
    messages = [[rng.choices(vocab, k=args.message_len) for _ in range(args.conversations)]
                for _ in range(args.turns)]
    longest = args.prefix_len + args.turns * (args.message_len + args.output_len)
    num_blocks = max(int(args.device_share * args.conversations * args.prefix_len / block_size),
                     -(-longest // block_size) + 1)
    rows, details = [], {}
    for label, tier in (("no tier", 0.0), ("host tier", args.tier_gib)):
        engine = LLM.from_config(dataclasses.replace(
            config, kv_cache_memory_bytes=num_blocks * bytes_per_block,
            kv_offloading_size=tier)).engine
        start = time.perf_counter()
        requests = run(engine, prefixes, messages, args.output_len)
        seconds = time.perf_counter() - start
        rows.append(_summary(label, requests, seconds,
                             len(requests) * args.output_len, engine.stats()))
        details[label] = requests
        if engine.kv.offload is not None:
            s = engine.kv.offload.stats
            rows[-1].update(offloaded_blocks=s.offloaded_blocks,
                            write_through_blocks=s.committed_blocks)
        engine.shutdown()
    result = {"model": config.model or "default", "device": config.device,
              "args": {k: getattr(args, k) for k in (
                  "conversations", "turns", "prefix_len", "message_len", "output_len",
                  "device_share", "tier_gib")},
              "device_blocks": num_blocks, "block_size": block_size, "runs": rows,
              "requests": details,
              "later_turn_ttft_speedup": rows[0]["ttft_p50_later_turns_s"]
              / rows[1]["ttft_p50_later_turns_s"]}
    print_table(f"{args.conversations} conversations x {args.turns} turns, device pool of "
                f"{num_blocks} blocks (later-turn TTFT speed-up "
                f"{result['later_turn_ttft_speedup']:.1f}x)", rows,
                ["run", "ttft_p50_turn1_s", "ttft_p50_later_turns_s", "output_tok_s",
                 "prefix_hit_rate", "host_hit_rate", "copy_s", "offloaded_blocks",
                 "write_through_blocks"])
    write_result("kv_offload", result, args.out)

"""``pagedserve bench kv-offload``: multi-turn conversations whose prefixes have left the
device pool, without and with the host offloading tier (``--kv-offloading-size``), in one
process: TTFT of the later turns and output tokens per second.

Each conversation starts with a prefix of its own; each turn's prompt is the previous prompt,
its answer and a new user message. ``--active-conversations`` conversations are under way at
once (a new one starts when one has had all its turns), and a conversation's next turn is
queued the moment its previous answer ends; at most ``--concurrency`` requests are in the
engine at once, the others wait in turn order. The device pool holds ``--device-share`` of all
the prefixes, so when the active conversations' histories exceed it, a conversation's blocks
are evicted by the turns queued ahead of its next one: without the tier its prefix is
recomputed, with it the prefix comes back from host memory. The tier must hold the active
histories for that (the JSON says whether it does: ``active_blocks`` against ``tier_blocks``),
which is what ``--active-conversations`` is for: a tier smaller than all the conversations'
histories would thrash under LRU if every conversation were under way in a cycle.

The CPU default, ``--concurrency 1`` with every conversation active, runs one request at a
time, turn by turn across the conversations (TTFT without queueing). The H200 row of issue 29
(``scripts/gpu_check.sh kv-tier``) runs 200 conversations of 4 turns, 80 active and 80
requests in flight, so the GPU is loaded and TTFT includes the wait in the queue
(``ttft_p50_later_turns_s``); the compute part alone, first scheduled to first token, is
``ttft_p50_later_turns_scheduled_s``.

``--unique-prefixes``: every turn's prompt is a fresh prefix and a message, so nothing can hit
(the tier only costs: its copies on eviction).

Fairness: both engines run a warm-up of their own before they are timed (conversations that
share nothing with the timed ones, enough to overflow the device pool, so kernels are compiled
and the tier has allocated its host pool and moved blocks both ways); the counters reported
are the timed run's alone. The JSON also records the blocks the tier copied on eviction
against those write-through would have copied (every committed block), the measurement behind
the tier's write-on-eviction policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from collections import deque

from pagedserve.arg_types import fraction, non_negative, positive
from pagedserve.bench.common import print_table, write_result

# Issue 29's targets: the tier's speed-up over no tier (later-turn TTFT, output tok/s).
TARGETS = {"multi-turn": {"later_turn_ttft_speedup": 5.0, "output_tok_s_ratio": 2.0},
           "unique-prefixes": {"later_turn_ttft_speedup": 0.97, "output_tok_s_ratio": 0.97}}


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--shape", default=None,
                        help="random weights of a real shape (dummy load format), e.g. "
                             "llama3-8b")
    parser.add_argument("--conversations", type=positive(int), default=8)
    parser.add_argument("--turns", type=positive(int), default=3)
    parser.add_argument("--prefix-len", type=positive(int), default=384)
    parser.add_argument("--message-len", type=non_negative(int), default=32)
    parser.add_argument("--output-len", type=positive(int), default=8)
    parser.add_argument("--active-conversations", type=positive(int), default=None,
                        help="conversations under way at once (default: all)")
    parser.add_argument("--concurrency", type=positive(int), default=1,
                        help="requests in the engine at once, at most")
    parser.add_argument("--unique-prefixes", action="store_true",
                        help="every turn a fresh prefix: all misses, what the tier costs")
    parser.add_argument("--device-share", type=fraction, default=0.25,
                        help="share of all the conversations' prefixes the device pool holds")
    parser.add_argument("--tier-gib", type=positive(float), default=1.0,
                        help="--kv-offloading-size of the run with the tier")
    parser.add_argument("--warm-up-conversations", type=non_negative(int), default=None,
                        help="two-turn conversations each engine runs before it is timed "
                             "(default: enough to overflow the device pool)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


class Conversations:
    """The prompts of every turn of every conversation: conversation ``c``'s next prompt is
    ``prompt(c)``; ``answered(c, tokens)`` records its answer and says whether a turn is
    left."""

    def __init__(self, vocab: list[int], num: int, turns: int, prefix_len: int,
                 message_len: int, unique: bool, seed: int) -> None:
        rng = random.Random(seed)
        # Drawn in the order of the first version, so its prompts are the same.
        self.history = [rng.choices(vocab, k=prefix_len) for _ in range(num)]
        self.messages = [[rng.choices(vocab, k=message_len) for _ in range(num)]
                         for _ in range(turns)]
        self.fresh = ([[rng.choices(vocab, k=prefix_len) for _ in range(num)]
                       for _ in range(turns - 1)] if unique else None)
        self.turn = [0] * num
        self.turns = turns

    def __len__(self) -> int:
        return len(self.history)

    def prompt(self, c: int) -> list[int]:
        if self.fresh is None or self.turn[c] == 0:
            return self.history[c]
        return self.fresh[self.turn[c] - 1][c] + self.messages[self.turn[c] - 1][c]

    def answered(self, c: int, tokens: list[int]) -> bool:
        if self.fresh is None:
            self.history[c] = self.history[c] + tokens + self.messages[self.turn[c]][c]
        self.turn[c] += 1
        return self.turn[c] < self.turns


def run(engine, conversations: Conversations, output_len: int, active: int,
        concurrency: int) -> list[dict]:
    """Every turn of every conversation (see the module doc for the order); a row per
    request, in the order they finished."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                            detokenize=False, output_kind="final_only")
    queued = deque(range(min(active, len(conversations))))  # conversations whose turn waits
    started, in_flight, rows = len(queued), {}, []
    while queued or in_flight:
        while queued and len(in_flight) < concurrency:
            c = queued.popleft()
            turn = conversations.turn[c]
            in_flight[engine.add_request(conversations.prompt(c), params)] = (c, turn)
        for out in engine.step():
            if not out.finished:
                continue
            c, turn = in_flight.pop(out.request_id)
            m = out.metrics
            rows.append({"conversation": c, "turn": turn,
                         "ttft_s": m.first_token_time - m.arrival_time,
                         "scheduled_ttft_s": m.first_token_time - m.first_scheduled_time,
                         "cached_tokens": m.num_cached_tokens})
            if conversations.answered(c, out.outputs[0].token_ids):
                queued.append(c)
            elif started < len(conversations):
                queued.append(started)
                started += 1
    return rows


def _since(before, after):
    """``after``'s counters less ``before``'s, for a dataclass of counters (``EngineStats``'
    gauges come out meaningless, and are not read)."""
    return dataclasses.replace(after, **{
        f.name: getattr(after, f.name) - getattr(before, f.name)
        for f in dataclasses.fields(after) if type(getattr(after, f.name)) in (int, float)})


def _summary(label: str, rows: list[dict], seconds: float, output_tokens: int, stats) -> dict:
    later = [r for r in rows if r["turn"] > 0]
    return {"run": label, "ttft_p50_turn1_s": statistics.median(
                [r["ttft_s"] for r in rows if r["turn"] == 0]),
            "ttft_p50_later_turns_s": statistics.median(r["ttft_s"] for r in later),
            "ttft_p50_later_turns_scheduled_s": statistics.median(
                r["scheduled_ttft_s"] for r in later),
            "output_tok_s": output_tokens / seconds, "seconds": seconds,
            "prefix_hit_rate": stats.prefix_hit_rate,
            "host_hit_rate": stats.prefix_hit_rate_of("host"),
            "bytes_to_host": stats.offload_bytes_to_host,
            "bytes_to_device": stats.offload_bytes_to_device,
            "copy_s": stats.offload_copy_s, "preemptions": stats.num_preemptions}


def _timed_run(config, args, vocab: list[int], label: str, tier_gib: float,
               num_blocks: int, bytes_per_block: int) -> tuple[dict, list[dict]]:
    """One engine: its warm-up, then the timed conversations; its summary and rows."""
    import gc
    import time

    from pagedserve.entrypoints.llm import LLM

    llm = LLM.from_config(dataclasses.replace(
        config, kv_cache_memory_bytes=num_blocks * bytes_per_block,
        kv_offloading_size=tier_gib))
    engine = llm.engine
    _warm_up(engine, args, vocab)
    offload = engine.kv.offload
    before, tier_before = engine.stats(), offload and dataclasses.replace(offload.stats)
    conversations = Conversations(vocab, args.conversations, args.turns, args.prefix_len,
                                  args.message_len, args.unique_prefixes, args.seed)
    start = time.perf_counter()
    rows = run(engine, conversations, args.output_len,
               args.active_conversations or args.conversations, args.concurrency)
    seconds = time.perf_counter() - start
    summary = _summary(label, rows, seconds, len(rows) * args.output_len,
                       _since(before, engine.stats()))
    if offload is not None:
        tier = _since(tier_before, offload.stats)
        summary.update(offloaded_blocks=tier.offloaded_blocks,
                       write_through_blocks=tier.committed_blocks)
    platform = engine.platform
    engine.shutdown()
    del llm, engine
    gc.collect()
    platform.release_cached_memory()  # the next engine's weights and pool
    return summary, rows


def _warm_up(engine, args, vocab: list[int]) -> None:
    """Two-turn conversations of the timed run's lengths, sharing no token sequence with it
    (another seed): by default two more than the device pool holds the prefixes of."""
    num = args.warm_up_conversations
    if num is None:
        num = int(args.device_share * args.conversations) + 2
    if num:
        run(engine, Conversations(vocab, num, 2, args.prefix_len, args.message_len,
                                  args.unique_prefixes, args.seed + 1),
            args.output_len, num, args.concurrency)


def _vocab(config) -> list[int]:
    """Ordinary token ids (no special one) of the model's tokenizer."""
    from pagedserve.models import loader

    source = loader.resolve_model(config.model, False, revision=config.revision,
                                  gguf_file=config.gguf_file)
    folder = loader.tokenizer_folder(source, config.tokenizer, config.tokenizer_revision)
    special = set(loader.load_tokenizer(folder).all_special_ids)
    return [t for t in range(loader.load_arch_config(source).vocab_size) if t not in special]


def main(args: argparse.Namespace) -> None:
    from pagedserve.bench.kv_copy_rate import kv_layout
    from pagedserve.bench.throughput import bench_config

    config = bench_config(args)
    layout = kv_layout(config)
    block_size, per_block = layout.block_size, layout.bytes_per_block
    vocab = _vocab(config)
    longest = args.prefix_len + args.turns * (args.message_len + args.output_len)
    num_blocks = max(int(args.device_share * args.conversations * args.prefix_len / block_size),
                     -(-longest // block_size) + 1)
    active = args.active_conversations or args.conversations
    rows, details = [], {}
    for label, tier in (("no tier", 0.0), ("host tier", args.tier_gib)):
        summary, details[label] = _timed_run(config, args, vocab, label, tier, num_blocks,
                                             per_block)
        rows.append(summary)
    workload = "unique-prefixes" if args.unique_prefixes else "multi-turn"
    result = {"model": args.shape or config.model or "default", "device": config.device,
              "workload": workload,
              "args": {k: getattr(args, k) for k in (
                  "conversations", "turns", "prefix_len", "message_len", "output_len",
                  "device_share", "tier_gib", "active_conversations", "concurrency",
                  "unique_prefixes", "warm_up_conversations", "max_num_batched_tokens")},
              "device_blocks": num_blocks, "block_size": block_size,
              "bytes_per_block": per_block,
              # What the tier must hold for the active conversations to come back from it.
              "active_blocks": active * -(-longest // block_size),
              "tier_blocks": int(args.tier_gib * 2**30) // per_block,
              "runs": rows, "requests": details,
              "later_turn_ttft_speedup": rows[0]["ttft_p50_later_turns_s"]
              / rows[1]["ttft_p50_later_turns_s"],
              "later_turn_scheduled_ttft_speedup": rows[0]["ttft_p50_later_turns_scheduled_s"]
              / rows[1]["ttft_p50_later_turns_scheduled_s"],
              "output_tok_s_ratio": rows[1]["output_tok_s"] / rows[0]["output_tok_s"],
              "targets": TARGETS[workload]}
    result["meets_targets"] = all(result[k] >= v for k, v in TARGETS[workload].items())
    print_table(f"{workload}: {args.conversations} conversations x {args.turns} turns, "
                f"{active} active, {args.concurrency} in flight, device pool of {num_blocks} "
                f"blocks (later-turn TTFT speed-up {result['later_turn_ttft_speedup']:.2f}x, "
                f"output tok/s {result['output_tok_s_ratio']:.2f}x)", rows,
                ["run", "ttft_p50_turn1_s", "ttft_p50_later_turns_s",
                 "ttft_p50_later_turns_scheduled_s", "output_tok_s", "prefix_hit_rate",
                 "host_hit_rate", "copy_s", "offloaded_blocks", "write_through_blocks"])
    write_result("kv_offload", result, args.out)

"""``pagedserve bench sharing``: what KV sharing and chunked prefill buy, measured on the engine.

* blocks: KV blocks held by n=4 parallel sampling and width-4 beam search, against the blocks
  the same streams would hold without sharing (the sum of their block tables), averaged over
  the steps and at the peak. The PagedAttention paper reports up to 55% saved.
* ttft: time to first token of requests that share a long system prompt, prefix caching on
  against off. The first request fills the cache; the ones after it are measured.
* itl: inter-token latency of running decodes while a long prompt arrives, chunked prefill on
  (a small token budget) against off (the whole prompt in one step).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from pagedserve.arg_types import positive
from pagedserve.bench.common import print_table, random_workload, write_result

PARTS = ("blocks", "ttft", "itl")


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--width", type=positive(int), default=4, help="n and beam width")
    parser.add_argument("--num-requests", type=positive(int), default=2)
    parser.add_argument("--prompt-len", type=positive(int), default=256)
    parser.add_argument("--output-len", type=positive(int), default=64)
    parser.add_argument("--system-prompt-len", type=positive(int), default=2000)
    parser.add_argument("--num-ttft-requests", type=positive(int), default=3)
    parser.add_argument("--long-prompt-len", type=positive(int), default=4000)
    parser.add_argument("--num-decodes", type=positive(int), default=4)
    parser.add_argument("--chunk-budget", type=positive(int), default=512,
                        help="--max-num-batched-tokens when chunked prefill is on")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


# ---- (a) blocks ---------------------------------------------------------------------------
def measure_blocks(engine, prompts: list[list[int]], params) -> dict:
    """Physical blocks in use against the sum of the streams' block tables, every step."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    physical, logical = [], []
    while engine.has_unfinished_requests():
        engine.step()
        physical.append(engine.kv.pool.num_used)
        logical.append(sum(len(t) for t in engine.kv.tables.values()))
    return {"peak_blocks": max(physical), "peak_blocks_unshared": max(logical),
            "saved_at_peak": 1 - max(physical) / max(logical),
            "saved_mean": 1 - sum(physical) / sum(logical)}


def run_blocks(config, args, rng: random.Random) -> list[dict]:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    engine = LLM.from_config(config).engine
    prompts = [_tokens(engine, rng, args.prompt_len) for _ in range(args.num_requests)]
    w, m = args.width, args.output_len
    cases = {
        f"n={w} sampling": SamplingParams(n=w, temperature=1.0, seed=0, max_tokens=m,
                                          ignore_eos=True),
        f"beam width {w}": SamplingParams(n=w, best_of=w, use_beam_search=True, max_tokens=m,
                                          ignore_eos=True),
    }
    return [{"case": name, **measure_blocks(engine, prompts, params)}
            for name, params in cases.items()]


# ---- (b) time to first token ----------------------------------------------------------
def measure_ttft(config, args, caching: bool, rng: random.Random) -> dict:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM.from_config(dataclasses.replace(config, enable_prefix_caching=caching))
    system = _tokens(llm.engine, rng, args.system_prompt_len)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttfts = []
    for _ in range(1 + args.num_ttft_requests):
        out = llm.generate([system + _tokens(llm.engine, rng, 32)], params, use_tqdm=False)[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return {"prefix_caching": caching, "first_ttft_s": ttfts[0],
            "ttft_s": statistics.mean(ttfts[1:]),
            "prefix_hit_rate": llm.engine.stats().prefix_hit_rate}


# ---- (c) inter-token latency --------------------------------------------------------------
def measure_itl(config, args, chunked: bool, rng: random.Random) -> dict:
    """Decodes run a few steps, then the long prompt arrives; ITL of the decodes' tokens
    until the long prompt has its first token, against their ITL before it came."""
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    budget = args.chunk_budget if chunked else None
    engine = LLM.from_config(dataclasses.replace(
        config, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)).engine
    # Enough tokens to keep decoding through every chunk of the long prompt.
    steps = 16 + args.long_prompt_len // args.chunk_budget
    decode = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    decodes = [engine.add_request(_tokens(engine, rng, 32), decode)
               for _ in range(args.num_decodes)]
    before = _decode_itls(engine, decodes, lambda _: False, steps=6)
    long_id = engine.add_request(_tokens(engine, rng, args.long_prompt_len),
                                 SamplingParams(max_tokens=1, ignore_eos=True))
    during = _decode_itls(engine, decodes, lambda outs: long_id in outs, steps=steps - 8)
    for request_id in decodes:
        engine.abort_request(request_id)
    return {"chunked_prefill": chunked, "budget": engine.scheduler.config.max_num_batched_tokens,
            "itl_before_ms": 1e3 * statistics.mean(before),
            "itl_mean_ms": 1e3 * statistics.mean(during), "itl_max_ms": 1e3 * max(during)}


def _decode_itls(engine, decodes: list[str], stop, steps: int) -> list[float]:
    """Gaps between the decodes' tokens over up to ``steps`` steps, until ``stop(ids)``."""
    last = time.perf_counter()
    gaps = []
    for _ in range(steps):
        finished = {o.request_id for o in engine.step()}
        now = time.perf_counter()
        gaps.append(now - last)  # every decode gets a token each step
        last = now
        if stop(finished):
            break
    return gaps[1:] if len(gaps) > 1 else gaps


def _tokens(engine, rng: random.Random, n: int) -> list[int]:
    avoid = set(engine.tokenizer.all_special_ids)
    return random_workload(1, (n, n), (1, 1), engine.arch.vocab_size, avoid,
                           rng.randrange(1 << 30))[0].prompt_token_ids


# ---- main -----------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> None:
    from pagedserve.engine_args import config_from_args

    config = config_from_args(args)
    rng = random.Random(args.seed)
    result = {"model": config.model or "default", "device": config.device, "args": {
        k: getattr(args, k) for k in ("width", "num_requests", "prompt_len", "output_len",
                                      "system_prompt_len", "long_prompt_len", "num_decodes",
                                      "chunk_budget")}}
    if "blocks" in args.parts:
        result["blocks"] = run_blocks(config, args, rng)
        print_table(f"(a) KV blocks, {args.num_requests} requests x {args.prompt_len} prompt "
                    f"tokens, {args.output_len} output tokens", result["blocks"],
                    ["case", "peak_blocks", "peak_blocks_unshared", "saved_at_peak",
                     "saved_mean"])
    if "ttft" in args.parts:
        result["ttft"] = [measure_ttft(config, args, on, rng) for on in (True, False)]
        on, off = result["ttft"]
        result["ttft_speedup"] = off["ttft_s"] / on["ttft_s"]
        print_table(f"(b) TTFT with a shared {args.system_prompt_len}-token system prompt "
                    f"(speed-up {result['ttft_speedup']:.1f}x)", result["ttft"],
                    ["prefix_caching", "first_ttft_s", "ttft_s", "prefix_hit_rate"])
    if "itl" in args.parts:
        result["itl"] = [measure_itl(config, args, on, rng) for on in (True, False)]
        print_table(f"(c) decode ITL while a {args.long_prompt_len}-token prompt arrives",
                    result["itl"], ["chunked_prefill", "budget", "itl_before_ms",
                                    "itl_mean_ms", "itl_max_ms"])
    write_result("sharing", result, args.out)

"""Benchmarks run as ``pagedserve bench NAME``; each module has ``add_args`` and ``main``."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "throughput": "offline engine vs HF transformers static batching",
    "decode": "decode step time against the memory roofline",
    "step-overhead": "host-side cost per sequence per decode step",
    "serve": "load a running server through its streaming API (TTFT, TPOT, ITL, throughput)",
    "quant-accuracy": "greedy agreement of each weight format with float32",
    "sharing": "KV blocks saved by n/beam sharing, TTFT with prefix caching, ITL with "
               "chunked prefill",
    "quant-kernels": "native CPU 4/8-bit quantized matmuls against torch's CPU ops",
    "structured": "TPOT of JSON-schema-constrained and free requests in one batch, against "
                  "an all-free batch; grammar compile time cold and cached",
    "long-prefill": "TTFT of a short request arriving during a long prefill, concurrent "
                    "partial prefills off and on",
    "speculative": "output tok/s with speculative decoding against without (batch-1 copy "
                   "prompts, or the throughput workload)",
    "kv-offload": "TTFT of multi-turn conversations whose prefixes left the device pool, "
                  "without and with the host offloading tier; all-miss prefixes with "
                  "--unique-prefixes",
    "kv-copy-rate": "KV block moves of the offloading tier against a contiguous copy of the "
                    "same bytes (pinned cudaMemcpyAsync on GPUs, memcpy on the CPU)",
    "lora": "output tok/s with requests spread over 1 / 8 / 32 LoRA adapters against the base "
            "model, the batch-1 decode step with an adapter, adapters cycling through slots",
}


def register_bench_commands(sub: argparse._SubParsersAction) -> None:
    for name, help_text in BENCHMARKS.items():
        parser = sub.add_parser(name, help=help_text)
        importlib.import_module(f"pagedserve.bench.{name.replace('-', '_')}").add_args(parser)
